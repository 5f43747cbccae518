"""The static-batching baseline pads prompts and outputs to each batch's longest member."""

from tools.bench_engine import PAD_TOKEN_ID, padded_batches


def test_padded_batches_pad_prompts_and_outputs_to_the_longest():
    workload = [([5, 6], 3), ([7, 8, 9, 10], 1), ([11], 2)]
    batches = list(padded_batches(workload, concurrency=2))
    pad = PAD_TOKEN_ID
    assert batches == [
        [(0, [pad, pad, 5, 6], 3, 3), (1, [7, 8, 9, 10], 3, 1)],
        [(2, [11], 2, 2)],
    ]
