import pytest

from engine.block_manager import BlockManager
from engine.params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence, SequenceStatus

EOS = 2


def make_scheduler(*, num_blocks=32, block_size=4, max_num_seqs=4, budget=8, max_model_len=64):
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    return Scheduler(config, BlockManager(num_blocks, block_size))


class Arrivals:
    def __init__(self, sched):
        self.sched, self.n = sched, 0

    def add(self, rid, prompt_len, priority=0, **params):
        params.setdefault("max_tokens", 100)
        seq = Sequence(
            rid,
            [10 + i for i in range(prompt_len)],
            SamplingParams(**params),
            seed=0,
            arrival=self.n,
            priority=priority,
        )
        self.n += 1
        self.sched.add(seq)
        return seq


def step(sched, token=100):
    """One scheduler iteration; every sequence that samples gets `token`."""
    out = sched.schedule()
    plan = [(s.seq.request_id, s.start, s.num_new_tokens) for s in out.scheduled]
    n_samples = sum(s.samples for s in out.scheduled)
    sched.update(out, [[token] for _ in range(n_samples)], None, EOS)
    return plan, [s.request_id for s in out.preempted]


def test_chunked_prefill_under_the_token_budget():
    sched = make_scheduler(budget=8)
    arr = Arrivals(sched)
    a = arr.add("a", 20)
    assert step(sched) == ([("a", 0, 8)], [])
    assert step(sched) == ([("a", 8, 8)], [])
    assert a.num_output_tokens == 0 and a.num_computed_tokens == 16
    arr.add("b", 6)
    # a finishes its prompt (4 tokens) and samples; b joins with the 4 tokens left of the budget
    assert step(sched) == ([("a", 16, 4), ("b", 0, 4)], [])
    assert a.output_token_ids == [100] and a.block_table == [0, 1, 2, 3, 4]
    assert step(sched) == ([("a", 20, 1), ("b", 4, 2)], [])
    assert step(sched) == ([("a", 21, 1), ("b", 6, 1)], [])
    assert b_tokens(sched, "b") == [100, 100]


def b_tokens(sched, rid):
    return next(s for s in sched.running if s.request_id == rid).output_token_ids


def test_long_interactive_prompt_never_stalls_running_decodes():
    sched = make_scheduler(budget=8)
    arr = Arrivals(sched)
    arr.add("batch0", 3, priority=1)
    arr.add("batch1", 3, priority=1)
    assert step(sched) == ([("batch0", 0, 3), ("batch1", 0, 3)], [])
    arr.add("chat", 30, priority=0)
    # running decodes first, then the newcomer takes what is left
    assert step(sched) == ([("batch0", 3, 1), ("batch1", 3, 1), ("chat", 0, 6)], [])
    # now chat sorts first, but one token stays reserved for each running decode
    assert step(sched) == ([("chat", 6, 6), ("batch0", 4, 1), ("batch1", 4, 1)], [])
    assert step(sched) == ([("chat", 12, 6), ("batch0", 5, 1), ("batch1", 5, 1)], [])
    plan, _ = step(sched)
    assert plan == [("chat", 18, 6), ("batch0", 6, 1), ("batch1", 6, 1)]
    plan, _ = step(sched)
    assert plan == [("chat", 24, 6), ("batch0", 7, 1), ("batch1", 7, 1)]
    assert b_tokens(sched, "chat") == [100]


def test_max_num_seqs_caps_admission_fcfs():
    sched = make_scheduler(max_num_seqs=2, budget=8)
    arr = Arrivals(sched)
    for rid in ("a", "b", "c"):
        arr.add(rid, 2, max_tokens=2)
    assert step(sched) == ([("a", 0, 2), ("b", 0, 2)], [])
    # a and b finish after this step (2 tokens each); c joins in the step after
    assert step(sched) == ([("a", 2, 1), ("b", 2, 1)], [])
    assert [s.request_id for s in sched.running] == []
    assert step(sched) == ([("c", 0, 2)], [])


def test_preemption_by_recompute_when_blocks_run_out():
    sched = make_scheduler(num_blocks=3, block_size=4, budget=16)
    arr = Arrivals(sched)
    a = arr.add("a", 4, max_tokens=3)
    b = arr.add("b", 4, max_tokens=3)
    assert step(sched) == ([("a", 0, 4), ("b", 0, 4)], [])
    assert sched.block_manager.num_free_blocks == 1
    # a takes the last block; b needs one too and is preempted (it is last in FCFS order)
    assert step(sched, token=101) == ([("a", 4, 1)], ["b"])
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.token_ids == [10, 11, 12, 13, 100] and b.block_table == []
    assert sched.num_preemptions == 1 and a.block_table == [0, 2]
    # b's recompute needs 2 blocks but 1 is free: it waits; a finishes (3 tokens) and frees
    assert step(sched) == ([("a", 5, 1)], [])
    assert a.status is SequenceStatus.FINISHED and a.finish_reason == "length"
    assert sched.block_manager.num_free_blocks == 3
    # b prefills prompt + its earlier output again, then samples its second token
    assert step(sched, token=102) == ([("b", 0, 5)], [])
    assert b.output_token_ids == [100, 102] and b.block_table == [1, 0]


def test_interactive_preempts_batch_when_no_room():
    sched = make_scheduler(max_num_seqs=1, budget=8)
    arr = Arrivals(sched)
    batch = arr.add("batch", 3, priority=1)
    assert step(sched) == ([("batch", 0, 3)], [])
    arr.add("chat", 2, priority=0)
    assert step(sched) == ([("chat", 0, 2)], ["batch"])
    assert batch.status is SequenceStatus.WAITING and batch.num_preemptions == 1
    assert [s.request_id for s in sched.waiting] == ["batch"]


def test_priority_then_fcfs_admission_order():
    sched = make_scheduler(max_num_seqs=4, budget=4)
    arr = Arrivals(sched)
    arr.add("b1", 2, priority=1)
    arr.add("i1", 2, priority=0)
    arr.add("b2", 2, priority=1)
    arr.add("i2", 2, priority=0)
    assert [s.request_id for s in sched.waiting] == ["i1", "i2", "b1", "b2"]
    assert step(sched) == ([("i1", 0, 2), ("i2", 0, 2)], [])


def test_join_and_leave_every_step_and_abort_frees_blocks():
    sched = make_scheduler(num_blocks=8, budget=8)
    arr = Arrivals(sched)
    a = arr.add("a", 5)
    assert step(sched) == ([("a", 0, 5)], [])
    b = arr.add("b", 3)
    assert step(sched) == ([("a", 5, 1), ("b", 0, 3)], [])
    assert sched.block_manager.num_free_blocks == 5
    sched.finish(a, "abort")
    assert sched.block_manager.num_free_blocks == 7 and a.block_table == []
    assert a.finish_reason == "abort" and a.status is SequenceStatus.FINISHED
    arr.add("c", 2)
    assert step(sched) == ([("b", 3, 1), ("c", 0, 2)], [])
    sched.finish(b, "abort")
    assert [s.request_id for s in sched.running] == ["c"]


@pytest.mark.parametrize(
    ("params", "tokens", "expected"),
    [
        ({"max_tokens": 5}, [7, EOS], ([7, EOS], "stop")),
        ({"max_tokens": 5, "ignore_eos": True}, [EOS] * 6, ([EOS] * 5, "length")),
        ({"max_tokens": 5, "stop_token_ids": (9,)}, [7, 9], ([7, 9], "stop")),
        ({"max_tokens": 2}, [7, 7, 7], ([7, 7], "length")),
        ({"max_tokens": 5, "min_tokens": 2}, [EOS, EOS, EOS], ([EOS, EOS], "stop")),
    ],
)
def test_stop_conditions(params, tokens, expected):
    sched = make_scheduler()
    seq = Arrivals(sched).add("r", 3, **params)
    for t in tokens:
        if seq.is_finished:
            break
        step(sched, token=t)
    assert (seq.output_token_ids, seq.finish_reason) == expected


def test_max_model_len_finishes_with_length():
    sched = make_scheduler(max_model_len=5)
    seq = Arrivals(sched).add("r", 3, max_tokens=10)
    step(sched)
    step(sched)
    assert seq.num_tokens == 5 and seq.finish_reason == "length"


def test_config_rejects_budget_below_max_num_seqs():
    with pytest.raises(ValueError, match="max_num_batched_tokens=4 < max_num_seqs=8"):
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4, max_model_len=64)


def test_a_draft_is_scheduled_and_verified_token_by_token():
    sched = make_scheduler(budget=16)
    arr = Arrivals(sched)
    a = arr.add("a", 5, temperature=0.0, stop_token_ids=(77,))
    step(sched, token=50)  # prefill, then the first output token
    assert (a.num_computed_tokens, a.output_token_ids) == (5, [50])
    # draft 60 61 62 after 50; verified (spec_decode.py): 60 and 61 stand, then the model's 70
    out = sched.schedule({"a": [60, 61, 62]})
    (s,) = out.scheduled
    assert (s.start, s.num_new_tokens, s.draft, s.num_sampled_rows) == (5, 4, (60, 61, 62), 4)
    updated = sched.update(out, [[60, 61, 70]], None, EOS)
    assert updated == [(a, 3)] and a.output_token_ids == [50, 60, 61, 70]
    assert a.num_computed_tokens == 8  # 50, 60, 61 have K/V; 70 (and the dropped 62) not
    assert (sched.num_draft_tokens, sched.num_accepted_draft_tokens) == (3, 2)
    # a stop id inside an accepted run ends the request there; the rest is dropped
    out = sched.schedule({"a": [71, 77, 72]})
    assert sched.update(out, [[71, 77, 72, 73]], None, EOS) == [(a, 2)]
    assert a.output_token_ids == [50, 60, 61, 70, 71, 77] and a.finish_reason == "stop"
    assert a.block_table == [] and sched.block_manager.num_free_blocks == 32


def test_a_draft_that_does_not_fit_the_budget_is_cut():
    sched = make_scheduler(budget=4)
    arr = Arrivals(sched)
    a, b = arr.add("a", 2, temperature=0.0), arr.add("b", 2, temperature=0.0)
    step(sched)
    assert a.output_token_ids == b.output_token_ids == [100]
    out = sched.schedule({"a": [5, 6, 7, 8]})  # 4 tokens: 1 for b, a's own, two of its draft
    assert [(s.seq.request_id, s.num_new_tokens, s.draft) for s in out.scheduled] == [
        ("a", 3, (5, 6)),
        ("b", 1, ()),
    ]
    assert b.num_computed_tokens == 2
