"""Two uploads of one weights version at once (a learner's request sent again while the first is still being
received, e.g. across a hub restart): each streams to its own temporary file, so one publishes the version whole and
the other is refused as not newer (409), never a 500 from a temporary file the other one removed or truncated."""

import asyncio

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save

from shared.weight_sync.relay_store import WeightsConflict, WeightStore

DATA = save({"w": torch.arange(4096, dtype=torch.float32)})


async def pieces(data: bytes, sizes: list[int], yields: list[int]):
    """``data`` in chunks of ``sizes`` (cycled), handing the loop to the other upload ``yields[i]`` times between."""
    start = i = 0
    while start < len(data):
        size = sizes[i % len(sizes)]
        yield data[start:start + size]
        start += size
        for _ in range(yields[i % len(yields)]):
            await asyncio.sleep(0)
        i += 1


@settings(max_examples=20, deadline=None)
@given(sizes=st.lists(st.lists(st.integers(1024, 8192), min_size=1, max_size=4), min_size=2, max_size=2),
       yields=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), min_size=2, max_size=2))
def test_two_uploads_of_one_version_publish_it_once_and_whole(tmp_path_factory, sizes, yields):
    store = WeightStore(tmp_path_factory.mktemp("relay"), max_bytes=2**24)

    async def both():
        return await asyncio.gather(*(store.receive(8, pieces(DATA, s, y)) for s, y in zip(sizes, yields)),
                                    return_exceptions=True)

    outcomes = asyncio.run(both())
    assert sorted(type(o).__name__ for o in outcomes) == ["WeightsConflict", "int"], outcomes
    assert [o for o in outcomes if isinstance(o, int)] == [len(DATA)]
    assert all("not newer" in str(o) for o in outcomes if isinstance(o, WeightsConflict))
    assert store.versions == [8] and store.path_for(8).read_bytes() == DATA
    assert list(store.directory.glob("*.partial")) == []
