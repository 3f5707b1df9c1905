"""The curriculum's pass-rate rule (shared/pass_rates.py): another rule on a filled table, by property."""

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.pass_rates import PassRates

histories = st.dictionaries(st.sampled_from(["a", "b", "c"]),
                            st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=1, max_size=8), max_size=3)


@settings(max_examples=200, deadline=None)
@given(histories=histories, old=st.tuples(st.integers(1, 6), st.integers(1, 6)),
       new=st.tuples(st.integers(1, 6), st.integers(1, 6)))
def test_a_new_rule_settles_as_a_table_filled_under_it_from_the_kept_shares(histories, old, new):
    (old_w, old_m), (new_w, new_m) = (old[0], min(old)), (new[0], min(new))
    table = PassRates(window=old_w, min_appearances=old_m)
    for key, shares in histories.items():
        for share in shares:
            table.record(key, share)
    table.set_rule(new_w, new_m)
    fresh = PassRates(window=new_w, min_appearances=new_m)
    for key, shares in histories.items():
        for share in shares[-old_w:]:          # what the old table kept
            fresh.record(key, share)
    assert table.settled() == fresh.settled()
    assert all(table.shares(key) == fresh.shares(key) for key in histories)


def test_record_says_when_the_settled_set_changed():
    table = PassRates(window=2, min_appearances=2)
    assert [table.record("a", s) for s in (1.0, 1.0, 1.0, 0.0)] == [False, True, False, True]
    assert table.settled_count() == 0 and len(table) == 1
