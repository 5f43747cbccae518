import pytest

from engine.params import SamplingParams
from engine.sequence import Sequence, SequenceStatus


def make(prompt=(1, 2, 3), **kw):
    return Sequence("r", list(prompt), SamplingParams(), seed=7, arrival=0, **kw)


def test_new_sequence_state():
    s = make()
    assert s.token_ids == [1, 2, 3] and s.token_ids is not s.prompt_token_ids
    assert (s.num_tokens, s.num_prompt_tokens, s.num_output_tokens) == (3, 3, 0)
    assert s.num_uncomputed_tokens == 3 and s.status is SequenceStatus.WAITING
    assert s.sort_key == (0, 0)


def test_append_only_after_everything_is_computed():
    s = make()
    with pytest.raises(AssertionError):
        s.append_token(9)
    s.num_computed_tokens = 3
    s.append_token(9)
    assert s.output_token_ids == [9] and s.num_uncomputed_tokens == 1


def test_reset_for_recompute_keeps_tokens_drops_kv():
    s = make()
    s.num_computed_tokens = 3
    s.append_token(9)
    s.block_table = [4]
    s.status = SequenceStatus.RUNNING
    s.reset_for_recompute()
    assert s.token_ids == [1, 2, 3, 9] and s.num_computed_tokens == 0 and s.block_table == []
    assert s.status is SequenceStatus.WAITING and s.num_preemptions == 1


def test_invariants_checked():
    with pytest.raises(ValueError, match="the prompt has no tokens"):
        make(prompt=())
    with pytest.raises(ValueError, match="priority=2"):
        make(priority=2)
    with pytest.raises(AssertionError, match="num_computed_tokens=4"):
        make(num_computed_tokens=4)
