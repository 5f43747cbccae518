"""Constrained decoding: every output parses and validates against its schema (22 schemas,
greedy and seeded, alone and batched), regex / choice / grammar outputs match, unconstrained
requests beside constrained ones keep every bit, preemption changes nothing, invalid
constraints are rejected at add_request, and compiled grammars are cached by key.

Most tests run a tiny random Llama that speaks SmolLM2's vocabulary (validity must hold
whatever the model says); a few run SmolLM2 itself.
"""

import dataclasses
import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from engine import Engine, EngineConfig, SamplingParams, load_tokenizer, sampler
from engine.errors import RequestRejected
from engine.grammar import GrammarCache, mask_words, token_bytes
from engine.params import Constraint
from engine.sampler import apply_token_bitmask_, disallowed_tokens
from tests.engine.tiny_llama import CONFIG, write_weights


def obj(required: list[str] | None = None, **props) -> dict:
    """An object schema with exactly these properties (all required unless `required` says)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


def s(max_length: int = 8, **kw) -> dict:
    return {"type": "string", "maxLength": max_length, **kw}


def i(lo: int, hi: int) -> dict:
    return {"type": "integer", "minimum": lo, "maximum": hi}


POINT = obj(x=i(0, 9), y=i(0, 9))
SCHEMAS = {  # bounded everywhere, so that any model reaches the end within max_tokens
    "flat": obj(name=s(12), age=i(0, 120)),
    "enum": obj(color={"enum": ["red", "green", "blue"]}),
    "bool_null": obj(ok={"type": "boolean"}, note={"type": "null"}),
    "int_array": obj(xs={"type": "array", "items": i(-5, 5), "minItems": 1, "maxItems": 4}),
    "nested": obj(user=obj(id=i(1, 999), email=s(10))),
    "array_of_objects": obj(points={"type": "array", "items": POINT, "maxItems": 3}),
    # a number's fraction is unbounded but for a multipleOf (the real model test has plain ones)
    "number_bounds": obj(
        price={"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}
    ),
    "const": obj(version={"const": 2}, kind={"const": "point"}),
    "mixed_enum": obj(level={"enum": [1, 2, 3, "high", None]}),
    "pattern": obj(code={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}),
    "optional": obj(required=["a"], a=i(0, 9), b={"type": "boolean"}),
    "top_array": {"type": "array", "items": {"enum": ["x", "y"]}, "minItems": 2, "maxItems": 3},
    "deep": obj(a=obj(b=obj(c={"type": "boolean"}))),
    "any_of": obj(value={"anyOf": [i(0, 9), s(5)]}),
    "nullable": obj(score={"type": ["integer", "null"], "minimum": -3, "maximum": 3}),
    "exclusive": obj(n={"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10}),
    "matrix": obj(
        m={
            "type": "array",
            "items": {"type": "array", "items": i(0, 9), "maxItems": 2},
            "maxItems": 2,
        }
    ),  # fmt: skip
    "string_lengths": obj(tag=s(4, minLength=2)),
    "refs": {
        "$defs": {"pt": POINT},
        **obj(start={"$ref": "#/$defs/pt"}, end={"$ref": "#/$defs/pt"}),
    },
    "record": obj(
        id=i(1, 99),
        title=s(10),
        done={"type": "boolean"},
        tags={"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    ),
    "negative_numbers": obj(t={"type": "number", "minimum": -40, "maximum": -1, "multipleOf": 0.5}),
    "date": obj(day={"type": "string", "format": "date"}),
}
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=96, seed=7)
GREEDY = dataclasses.replace(SEEDED, temperature=0.0)


@pytest.fixture(scope="module")
def vocab_dir(tmp_path_factory) -> Path:
    return write_tiny_smollm_vocab(tmp_path_factory.mktemp("tiny") / "llama")


def write_tiny_smollm_vocab(path: Path) -> Path:
    """A tiny random Llama (tests/engine/tiny_llama.py's shape) with SmolLM2's tokenizer."""
    path.mkdir(parents=True)
    tok = load_tokenizer("smollm2-135m")
    write_weights(path, {**CONFIG, "vocab_size": tok.vocab_size, "torch_dtype": "bfloat16"})
    tok._backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )
    return path


def tiny_engine(model: Path, **kw) -> Engine:
    kw.setdefault("num_kv_blocks", 1024)
    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("max_num_batched_tokens", 512)
    # bf16 batch-invariant: a row's logits do not depend on what shares its step
    return Engine(
        EngineConfig(model=str(model), dtype="bfloat16", batch_invariant=True, block_size=4, **kw)
    )


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    """Add every request, step to the end; -> {request id: (token ids, logprobs, reason)}."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: ([], [], None) for rid in requests}
    while engine.has_unfinished_requests():
        for o in engine.step():
            ids, lps, _ = out[o.request_id]
            ids += o.new_token_ids
            lps += o.new_logprobs or []
            out[o.request_id] = (ids, lps, o.finish_reason)
    return out


def schema_requests(prompt: list[int]) -> dict[str, tuple[list[int], SamplingParams]]:
    reqs = {}
    for name, schema in SCHEMAS.items():
        c = Constraint.json_schema(schema)
        reqs[f"greedy-{name}"] = (prompt, dataclasses.replace(GREEDY, constraint=c))
        reqs[f"seeded-{name}"] = (prompt, dataclasses.replace(SEEDED, constraint=c))
    return reqs


def assert_valid(tok, rid: str, ids: list[int], reason: str | None) -> None:
    schema = SCHEMAS[rid.split("-", 1)[1]]
    text = tok.decode(ids)
    assert reason == "stop", f"{rid}: {reason} after {len(ids)} tokens: {text!r}"
    assert 2 not in ids, f"{rid}: the grammar ended the request, not eos"
    jsonschema.validate(json.loads(text), schema)


def test_every_schema_valid_greedy_and_seeded_batched_and_alone(vocab_dir):
    engine = tiny_engine(vocab_dir)
    tok = engine.tokenizer
    prompt = tok.encode("Give me JSON:")
    reqs = schema_requests(prompt)
    batched = run(engine, reqs)
    for rid, (ids, _, reason) in batched.items():
        assert_valid(tok, rid, ids, reason)
    assert len({tuple(ids) for ids, _, _ in batched.values()}) > len(SCHEMAS)  # not one answer
    for rid in list(reqs)[::3]:  # a third of them alone: the same tokens as batched
        assert run(engine, {rid: reqs[rid]})[rid] == batched[rid], rid
    assert engine.grammars.num_compiled == len(SCHEMAS)  # greedy and seeded share one grammar


def test_unconstrained_requests_beside_constrained_ones_keep_every_bit(vocab_dir):
    engine = tiny_engine(vocab_dir)
    tok = engine.tokenizer
    plain = {
        f"plain{k}": (tok.encode(text), dataclasses.replace(p, max_tokens=24, logprobs=2))
        for k, (text, p) in enumerate(
            [("Hello", GREEDY), ("Once upon", SEEDED), ("1, 2,", SEEDED), ("def f", GREEDY)]
        )
    }
    alone = run(engine, plain)
    prompt = tok.encode("JSON:")
    both = run(engine, plain | schema_requests(prompt))
    for rid in plain:  # token ids and logprobs (floats from the raw logits): the same bits
        assert both[rid] == alone[rid], rid
    for rid in both.keys() - plain.keys():
        assert_valid(tok, rid, *both[rid][::2])


def test_preemption_keeps_outputs_valid_and_equal(vocab_dir):
    prompt = load_tokenizer("smollm2-135m").encode("Some JSON, please:")
    names = ["record", "array_of_objects", "refs", "deep"]
    reqs = {
        f"{kind}-{name}": (prompt, dataclasses.replace(p, constraint=Constraint.json_schema(s)))
        for name, s in ((n, SCHEMAS[n]) for n in names)
        for kind, p in (("greedy", GREEDY), ("seeded", SEEDED))
    }
    roomy = run(tiny_engine(vocab_dir), reqs)
    tight_engine = tiny_engine(
        vocab_dir, num_kv_blocks=32, max_num_batched_tokens=32, max_num_seqs=12
    )
    tight = run(tight_engine, reqs)
    assert tight_engine.stats().num_preemptions > 0  # 128 KV slots for 8 growing requests
    assert tight == roomy
    for rid, (ids, _, reason) in tight.items():
        assert_valid(tight_engine.tokenizer, rid, ids, reason)


def test_a_resumed_run_goes_on_where_its_grammar_was(vocab_dir):
    """A run that continues an earlier one (its output now ends the prompt) hands that output to
    the grammar: the rest is what the whole run would have said; a complete one ends at once."""
    engine = tiny_engine(vocab_dir)
    prompt = engine.tokenizer.encode("JSON:")
    params = dataclasses.replace(GREEDY, constraint=Constraint.json_schema(SCHEMAS["record"]))
    full, _, reason = run(engine, {"whole": (prompt, params)})["whole"]
    assert reason == "stop" and len(full) > 6
    k = len(full) // 2
    rest = dataclasses.replace(params, max_tokens=params.max_tokens - k)
    engine.add_request("rest", prompt + full[:k], rest, constrained_output_ids=full[:k])
    out = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
            finish = o.finish_reason
    assert (full[:k] + out, finish) == (full, "stop")
    engine.add_request("ended", prompt + full, rest, constrained_output_ids=full)
    (o,) = engine.step()
    assert (o.request_id, o.finished, o.finish_reason, o.new_token_ids) == (
        "ended",
        True,
        "stop",
        [],
    )
    assert not engine.has_unfinished_requests()
    with pytest.raises(RequestRejected) as info:
        engine.add_request("bad", prompt, params, constrained_output_ids=full[1:])
    assert info.value.field == "constrained_output_ids"


def test_regex_choice_and_grammar_outputs_match(vocab_dir):
    engine = tiny_engine(vocab_dir)
    tok = engine.tokenizer
    prompt = tok.encode("Answer:")
    email = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    colors = ["red", "green", "light blue", "dark blue"]
    lark = 'start: "(" D ("," D)~0..3 ")"\nD: /[0-9]/'
    gbnf = 'root ::= "yes" | "no" | "n=" [0-9] [0-9]?'
    checks = {
        "regex": (Constraint("regex", email), lambda t: re.fullmatch(email, t)),
        "choice": (Constraint.choice(colors), lambda t: t in colors),
        "lark": (Constraint("grammar", lark), lambda t: re.fullmatch(r"\(\d(,\d){0,3}\)", t)),
        "gbnf": (Constraint("grammar", gbnf), lambda t: re.fullmatch(r"yes|no|n=\d\d?", t)),
    }
    reqs = {
        f"{kind}-{name}-{seed}": (prompt, dataclasses.replace(p, seed=seed, constraint=c))
        for name, (c, _) in checks.items()
        for kind, p in (("greedy", GREEDY), ("seeded", SEEDED))
        for seed in range(3)
    }
    out = run(engine, reqs)
    for rid, (ids, _, reason) in out.items():
        text = tok.decode(ids)
        assert reason == "stop" and checks[rid.split("-")[1]][1](text), (rid, text, reason)


@pytest.mark.parametrize(
    ("constraint", "field", "problem"),
    [
        (Constraint("json_schema", '{"type": "objekt"}'), "response_format.json_schema", "objekt"),
        (Constraint.json_schema({"type": "string", "format": "weird"}), None, "weird"),
        (Constraint("regex", "(("), "guided_regex", "unclosed group"),
        (Constraint("grammar", "start: foo\nfoo: bar"), "guided_grammar", "bar"),
        (Constraint("grammar", "root ::= ("), "guided_grammar", ""),
    ],
)
def test_an_invalid_constraint_is_rejected_at_add_request(vocab_dir, constraint, field, problem):
    engine = tiny_engine(vocab_dir)
    params = dataclasses.replace(GREEDY, constraint=constraint)
    with pytest.raises(RequestRejected) as info:
        engine.add_request("bad", [1, 2, 3], params)
    assert info.value.code == "invalid_request"
    assert info.value.field == (field or "response_format.json_schema")
    assert problem in info.value.message and info.value.message.startswith(info.value.field)
    assert not engine.has_unfinished_requests()


def test_constraint_form_is_checked_when_built():
    with pytest.raises(RequestRejected, match="not valid JSON"):
        Constraint("json_schema", "{nope")
    with pytest.raises(RequestRejected, match="non-empty JSON list"):
        Constraint.choice([])
    with pytest.raises(RequestRejected, match="constraint.kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(RequestRejected, match="min_tokens"):
        SamplingParams(min_tokens=1, constraint=Constraint("json_object"))
    with pytest.raises(RequestRejected, match="ignore_eos"):
        SamplingParams(ignore_eos=True, constraint=Constraint("json_object"))
    # whitespace does not change the key; property order (the order generated) does
    a = Constraint("json_schema", '{"type": "object", "properties": {"a": {}, "b": {}}}')
    b = Constraint("json_schema", '{"type":"object","properties":{"a":{},"b":{}}}')
    c = Constraint("json_schema", '{"type":"object","properties":{"b":{},"a":{}}}')
    assert a.key == b.key != c.key


def test_grammars_are_compiled_once_per_key():
    tok = load_tokenizer("smollm2-135m")
    cache = GrammarCache(tok, tok.vocab_size)
    flat = Constraint.json_schema(SCHEMAS["flat"])
    first = cache.compile(flat)
    assert cache.compile(Constraint.json_schema(json.dumps(SCHEMAS["flat"], indent=2))) is first
    cache.compile(Constraint.json_schema(SCHEMAS["enum"]))
    assert cache.num_compiled == 2
    m1, m2 = cache.matcher(flat), cache.matcher(flat)  # each sequence its own state
    for t in tok.encode('{"name":"ab'):
        m1.accept(t)
    assert m1.num_accepted == 4 and m2.num_accepted == 0
    masks = cache.fill_masks([m1, m2])
    assert masks.shape == (2, mask_words(tok.vocab_size)) and not (masks[0] == masks[1]).all()


def test_token_bytes_follow_gpt2_byte_level_and_mark_special_tokens():
    tok = load_tokenizer("smollm2-135m")
    pieces = token_bytes(tok, tok.vocab_size + 3)  # a padded model vocabulary
    for text in ["Hello world", ' {"a": 1}\n', "héllo ✓", "\t\tx"]:
        assert b"".join(pieces[t] for t in tok.encode(text)) == text.encode()
    assert pieces[tok.eos_token_id] == b"\xff<|im_end|>"
    assert pieces[-3:] == [b"", b"", b""]


def test_mask_changes_only_constrained_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=g)  # 70 tokens: 3 words, the last one partial
    bitmask = torch.zeros(2, 3, dtype=torch.int32)
    bitmask[0, 0] = 1 << 5  # row 1 allows token 5
    bitmask[1, 2] = (1 << 3) | (1 << 1)  # row 3 allows tokens 67 and 65
    bitmask[1, 0] = -(2**31)  # bit 31: token 31
    # the CPU's unpacking (numpy) and a GPU's (shifts) agree, bit 31 (the sign) included
    random = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=g, dtype=torch.int32)
    for b in (bitmask, random):
        assert torch.equal(disallowed_tokens(b, 70), sampler._unpack_with_shifts(b, 70))
    out = logits.clone()
    apply_token_bitmask_(out, [1, 3], bitmask)
    assert torch.equal(out[[0, 2]], logits[[0, 2]])
    assert out[1].isfinite().nonzero().flatten().tolist() == [5]
    assert out[3].isfinite().nonzero().flatten().tolist() == [31, 65, 67]
    assert torch.equal(out[3, [31, 65, 67]], logits[3, [31, 65, 67]])
    everything = logits.clone()
    apply_token_bitmask_(everything, [0, 1, 2, 3], torch.full((4, 3), -1, dtype=torch.int32))
    assert torch.equal(everything, logits)


def test_smollm2_outputs_are_valid_greedy_and_seeded():
    """The real model on a chat prompt: valid JSON for three schemas, a regex and a choice."""
    engine = Engine(EngineConfig(dtype="bfloat16", num_kv_blocks=64))  # int4 GEMVs: validity only
    tok = engine.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": "Describe a person in JSON."}])
    params = SamplingParams(temperature=0.0, max_tokens=40, seed=3)
    reqs = {}
    for name in ("flat", "record", "enum"):
        c = Constraint.json_schema(SCHEMAS[name])
        reqs[f"greedy-{name}"] = (prompt, dataclasses.replace(params, constraint=c))
    c = Constraint.json_schema(SCHEMAS["flat"])
    reqs["seeded-flat"] = (prompt, dataclasses.replace(params, temperature=0.8, constraint=c))
    age = r"[A-Z][a-z]{1,9} is [1-9][0-9]? years old\."
    reqs["regex"] = (prompt, dataclasses.replace(params, constraint=Constraint("regex", age)))
    yes_no = Constraint.choice(["yes", "no"])
    reqs["choice"] = (prompt, dataclasses.replace(params, constraint=yes_no))
    out = run(engine, reqs)
    for rid, (ids, _, reason) in out.items():
        if rid.startswith(("greedy", "seeded")):
            assert_valid(tok, rid, ids, reason)
    assert out["regex"][2] == "stop" and re.fullmatch(age, tok.decode(out["regex"][0]))
    assert tok.decode(out["choice"][0]) in ("yes", "no")
