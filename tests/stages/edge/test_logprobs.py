"""Logprobs in OpenAI's shapes from `tokens` events, with the served tokenizer: exact bytes of
a token that holds part of a character, the end-of-sequence token left out, nothing after a stop
string, legacy text offsets in characters; and the tokens events a run's watch keeps by seq."""

import pytest

from schemas.events import RunFinished, TokenLogprob, TokensGenerated
from stages.edge.logprobs import Logprobs, TokenEvents, TokenText
from stages.tokenize import tokenizer_for
from tests.stages.edge_harness import MODEL

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tok():
    return tokenizer_for(MODEL)


def _event(seq: int, ids: list[int], alternatives: list[int], rid: str = "r1") -> TokensGenerated:
    logprobs = [
        [TokenLogprob(t, -0.5 - k)]
        + [TokenLogprob(a, -1.0 - j) for j, a in enumerate(alternatives)]
        for k, t in enumerate(ids)
    ]
    return TokensGenerated(request_id=rid, seq=seq, token_ids=ids, logprobs=logprobs)


def test_token_bytes_are_exact_and_join_into_the_text(tok):
    text = TokenText(tok)
    ids = tok.encode("Hello wörld 🙂")
    pieces = [text(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in pieces).decode() == "Hello wörld 🙂"
    for token, raw in pieces:
        assert token == bytes(raw).decode("utf-8", errors="replace")
    assert text(tok.eos_token_id) == (tok.eos_token, list(tok.eos_token.encode()))


def test_chat_shape_leaves_out_the_end_and_what_follows_a_stop(tok):
    hello, world = tok.encode("Hello"), tok.encode(" world")
    lp = Logprobs(TokenText(tok), chat=True, num_top=2)
    part = lp.add(_event(0, hello, [world[0], hello[0]]))
    assert part == {
        "content": [
            {
                "token": "Hello",
                "logprob": -0.5,
                "bytes": list(b"Hello"),
                "top_logprobs": [
                    {"token": " world", "logprob": -1.0, "bytes": list(b" world")},
                    {"token": "Hello", "logprob": -2.0, "bytes": list(b"Hello")},
                ],
            }
        ],
        "refusal": None,
    }
    assert lp.add(_event(1, [tok.eos_token_id], [world[0], hello[0]])) is None  # eos: no token
    assert lp.add(None) is None  # the final flush has no tokens event
    lp.stopped = True
    assert lp.add(_event(2, world, [hello[0], world[0]])) is None
    assert [e["token"] for e in lp.whole()["content"]] == ["Hello"]


def test_legacy_shape_offsets_count_characters(tok):
    ids = tok.encode("aé b")
    lp = Logprobs(TokenText(tok), chat=False, num_top=1)
    half = len(ids) // 2
    first = lp.add(_event(0, ids[:half], [ids[0]]))
    lp.add(_event(1, ids[half:], [ids[0]]))
    whole = lp.whole()
    assert "".join(whole["tokens"]).replace("\ufffd", "") in "aé b"
    assert first["tokens"] == whole["tokens"][:half]
    assert len(whole["text_offset"]) == len(ids) == len(whole["token_logprobs"])
    assert whole["text_offset"][0] == 0
    text = "aé b"
    for offset, token in zip(whole["text_offset"], whole["tokens"], strict=True):
        if "\ufffd" not in token:  # a whole-character token starts at its offset
            assert text[offset:].startswith(token), (offset, token)
    for sampled, alternatives in zip(whole["tokens"], whole["top_logprobs"], strict=True):
        assert sampled in alternatives and len(alternatives) <= 2  # top-1 plus the sampled one


def test_a_tokens_event_without_logprobs_is_an_error(tok):
    lp = Logprobs(TokenText(tok), chat=True, num_top=0)
    with pytest.raises(RuntimeError, match="no logprobs"):
        lp.add(TokensGenerated(request_id="r1", seq=0, token_ids=[5]))


async def test_token_events_by_seq_and_the_flush_without_one():
    events = TokenEvents(js=None, request_id="r1")  # nothing here needs the log
    events.observe(_event(0, [5], []))
    events.observe(_event(0, [6], []))  # a redelivery: the first stands
    events.observe(_event(1, [7], [], rid="other"))
    events.observe(RunFinished(request_id="r1", finish_reason="stop", last_seq=0))
    assert (await events.take(0)).token_ids == [5]
    assert await events.take(1) is None  # past the last tokens event: the flush


def test_echo_puts_the_prompts_tokens_first_the_first_without_a_logprob(tok):
    prompt, done = tok.encode("The sky is"), tok.encode(" blue")
    lp = Logprobs(TokenText(tok), chat=False, num_top=1)
    ranked = [[TokenLogprob(t, -0.25 * (i + 1)), TokenLogprob(done[0], -3.0)]
              for i, t in enumerate(prompt[1:])]  # fmt: skip
    part = lp.add_prompt(prompt, ranked)
    assert part["tokens"] == ["The", " sky", " is"]
    assert part["token_logprobs"] == [None, -0.25, -0.5]
    assert part["top_logprobs"] == [
        None,
        {" blue": -3.0, " sky": -0.25},
        {" blue": -3.0, " is": -0.5},
    ]
    assert part["text_offset"] == [0, 3, 7]
    lp.add(_event(0, done, [done[0]]))
    whole = lp.whole()
    assert whole["tokens"] == ["The", " sky", " is", " blue"]
    assert whole["text_offset"] == [0, 3, 7, 10]  # the completion's offsets follow the prompt's
    with pytest.raises(RuntimeError, match="not the prompt's"):
        Logprobs(TokenText(tok), chat=False, num_top=1).add_prompt(prompt, ranked[::-1])
