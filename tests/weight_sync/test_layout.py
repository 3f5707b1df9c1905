"""The flat layout, its buckets and the unpacker; the rendezvous endpoints' answers to bad requests."""

import pytest
import requests
import torch
from safetensors import safe_open

from shared.weight_sync.layout import BucketUnpacker, Layout, bucket_ranges
from shared.weight_sync.sender import SafetensorsStream
from tests.live_server import LiveServer, make_config

TENSORS = {"a": torch.arange(6.0).reshape(2, 3), "empty": torch.zeros(0, 4), "b": torch.arange(10.0) * -1,
           "c": torch.full((3, 5), 2.5), "last_empty": torch.zeros(0)}


def flat(tensors):
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])


def layout():
    return Layout.build([(n, tuple(t.shape)) for n, t in TENSORS.items()], torch.float32)


def test_buckets_cover_the_bytes_once_and_are_bounded():
    assert bucket_ranges(100, 40) == [(0, 40), (40, 80), (80, 100)]
    assert bucket_ranges(0, 8) == []
    with pytest.raises(ValueError, match="multiple of 8"):
        bucket_ranges(100, 12)


@pytest.mark.parametrize("bucket", [8, 16, 24, 1024])
def test_unpacker_gives_every_tensor_back_whatever_the_bucket_size(bucket):
    data, spec = flat(TENSORS), layout()
    assert spec.total_bytes == data.numel() == (6 + 10 + 15) * 4
    unpacker, out = BucketUnpacker(spec), {}
    for begin, end in bucket_ranges(spec.total_bytes, bucket):
        receive_buffer = data[begin:end].clone()  # what one broadcast delivers, overwritten by the next one
        for name, tensor in unpacker.feed(begin, receive_buffer):
            out[name] = tensor.clone()
    assert unpacker.done and list(out) == list(TENSORS)
    for name, tensor in TENSORS.items():
        assert torch.equal(out[name], tensor), name


def test_header_and_buffer_are_a_safetensors_file_and_the_layout_survives_json(tmp_path):
    spec = layout()
    assert Layout.from_json(spec.to_json()) == spec and Layout.from_json(spec.to_json()).fingerprint() == \
        spec.fingerprint()
    reader = SafetensorsStream(spec.safetensors_header({"grpo_version": "7"}), flat(TENSORS), chunk_bytes=16)
    path = tmp_path / "v.safetensors"
    path.write_bytes(b"".join(iter(lambda: reader.read(13), b"")))  # odd read sizes across header and chunks
    assert len(reader) == path.stat().st_size
    with safe_open(str(path), framework="pt") as fh:
        assert fh.metadata()["grpo_version"] == "7"
        for name, tensor in TENSORS.items():
            assert torch.equal(fh.get_tensor(name), tensor), name


@pytest.mark.slow
def test_rendezvous_refuses_what_it_cannot_honour(tmp_path):
    with LiveServer(make_config(tmp_path)) as live:
        join = {"generator_id": "g", "transport": "collective"}
        answer = live.post("/v1/weights/sync/members", json=join)
        assert answer.status_code == 409 and "no weight-sync sender is registered" in answer.json()["detail"]
        sender = {"sender_id": "s1", "host": "127.0.0.1", "backend": "mpi", "layout": [], "bucket_bytes": 8,
                  "timeout_s": 1}
        assert live.state.sync.sender is None
        assert requests.put(live.url + "/v1/weights/sync/sender", json=sender).status_code == 422
        answer = live.post("/v1/weights/sync/announce", json={"sender_id": "nobody", "version": 3})
        assert answer.status_code == 409 and "not the registered weight-sync sender" in answer.json()["detail"]
        poll = live.post("/v1/weights/sync/members/m9-x/poll", json={"version": 0})
        assert poll.status_code == 200 and poll.json()["action"] == "rejoin"
        assert live.get("/v1/weights/sync").json()["sender"] is None
