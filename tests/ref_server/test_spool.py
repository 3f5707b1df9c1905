"""The hub's spool on its own: commit by rename, reload in sequence order, unfinished and refused files."""

import pytest

from ref_server.hub.spool import RolloutSpool
from shared.protocol.errors import ProtocolError

from .helpers import make_group


def test_reload_returns_committed_groups_in_sequence_order(tmp_path):
    spool = RolloutSpool(tmp_path / "spool")
    groups = [make_group(seed=i) for i in range(3)]
    # written out of order and committed with sequence numbers past 9 (a string sort of unpadded numbers would fail)
    for seq, group in [(12, groups[2]), (3, groups[0]), (10, groups[1])]:
        tmp = spool.write(group.group_id, group.to_bytes())
        assert tmp.name.endswith(".tmp")
        path = spool.commit(tmp, seq, group.group_id)
        assert path.name == f"{seq:012d}-{group.group_id}.group" and not tmp.exists()
    spool.write("unfinished", b"half a gro")  # a write the process died in: never committed
    found = RolloutSpool(tmp_path / "spool").reload(lambda group: None)
    assert found.corrupt == 0
    assert [(s.seq, s.group.group_id) for s in found.groups] == [(3, groups[0].group_id), (10, groups[1].group_id),
                                                                (12, groups[2].group_id)]
    assert found.groups[1].group.rewards.tolist() == groups[1].rewards.tolist()
    assert not list((tmp_path / "spool").glob("*.tmp"))
    spool.remove(found.groups[0].path)
    spool.remove(found.groups[0].path)  # removing twice is harmless (a late acknowledgement)
    assert [s.seq for s in spool.reload(lambda group: None).groups] == [10, 12]


def test_unreadable_and_refused_files_move_to_corrupt(tmp_path):
    spool = RolloutSpool(tmp_path)
    keep, refuse = make_group(seed=0), make_group(seed=1, temperature=0.5)
    for seq, group in enumerate([keep, refuse]):
        spool.commit(spool.write(group.group_id, group.to_bytes()), seq, group.group_id)
    (tmp_path / "000000000007-garbage.group").write_bytes(b"not a group")
    (tmp_path / "noseq-x.group").write_bytes(keep.to_bytes())

    def check(group):
        if group.sampling.temperature != 1.0:
            raise ProtocolError("other temperature")

    found = spool.reload(check)
    assert [s.group.group_id for s in found.groups] == [keep.group_id] and found.corrupt == 3
    assert sorted(p.name for p in (tmp_path / "corrupt").iterdir()) == sorted(
        ["000000000007-garbage.group", "noseq-x.group", f"000000000001-{refuse.group_id}.group"])
    assert [p.name for p in tmp_path.glob("*.group")] == [f"000000000000-{keep.group_id}.group"]


def test_a_check_error_other_than_a_value_error_is_not_swallowed(tmp_path):
    spool = RolloutSpool(tmp_path)
    group = make_group()
    spool.commit(spool.write(group.group_id, group.to_bytes()), 0, group.group_id)

    def broken(group):
        raise RuntimeError("bug")

    with pytest.raises(RuntimeError, match="bug"):
        spool.reload(broken)
    assert (tmp_path / f"000000000000-{group.group_id}.group").exists()
