"""Structured output in the engine (engine/structured.py) with the real demo model and xgrammar:
the compile cache, field-named errors, the batched bitmask (constrained rows only), a decode-side
matcher that catches up with the prefill worker's first token, and 20 JSON-schema outputs that parse
and validate. Every engine test ends with no KV block leaked."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from common.errors import InvalidRequestError
from common.sampling import StructuredOutput
from engine import SamplingParams
from engine.sampler import Sample
from engine.sequence import Sequence
from engine.structured import GrammarCache, StructuredOutputs
from tests.conftest import assert_no_leaked_blocks, make_engine, run_to_completion

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
PERSON_CONSTRAINT = StructuredOutput("json_schema", json.dumps(PERSON))
PROMPTS = [f"Describe {who} as JSON." for who in (
    "a French chef", "a retired pilot", "a young programmer", "an old sailor", "a math teacher", "a jazz singer",
    "a farmer from Kenya", "a Japanese potter", "a marathon runner", "a museum guard", "a chess champion",
    "a beekeeper", "a night nurse", "a carpenter", "a tour guide in Rome", "a violin maker", "a librarian",
    "an astronaut", "a street musician", "a lighthouse keeper")]


@pytest.fixture(scope="module")
def grammars(demo_model) -> GrammarCache:
    return GrammarCache(demo_model.tokenizer, demo_model.config.vocab_size, demo_model.eos_token_ids)


def _seq(request_id: str, constraint: StructuredOutput | None, output: list[int] = ()) -> Sequence:
    seq = Sequence(request_id, [1, 2, 3], SamplingParams(max_tokens=32, structured=constraint))
    seq.output_token_ids.extend(output)
    return seq


def test_a_constraint_is_compiled_once(grammars):
    constraint = StructuredOutput("regex", "[0-9]{3}")
    first = grammars.get(constraint)
    hits = grammars.hits
    assert grammars.get(StructuredOutput("regex", "[0-9]{3}")) is first
    assert grammars.hits == hits + 1


@pytest.mark.parametrize("constraint", [
    StructuredOutput("json_schema", '{"type": "wizard"}'),
    StructuredOutput("json_schema", "{not json"),
    StructuredOutput("regex", "[a-"),
    StructuredOutput("grammar", "root ::= missing_rule"),
])
def test_an_invalid_constraint_names_the_field(grammars, constraint):
    with pytest.raises(InvalidRequestError) as err:
        grammars.get(constraint)
    assert err.value.field == "structured_output"


def test_only_constrained_rows_are_masked(grammars, demo_model):
    tokenizer, vocab = demo_model.tokenizer, demo_model.config.vocab_size
    structured = StructuredOutputs(grammars)
    free = [_seq("a", None), _seq("b", None)]
    logits = torch.randn(2, vocab)
    assert structured.mask(logits, free, in_place=False) is logits  # nothing constrained: no work
    seqs = [_seq("a", None), _seq("b", StructuredOutput("regex", "[0-9]+")), _seq("c", None)]
    logits = torch.randn(3, vocab)
    out = structured.mask(logits, seqs, in_place=False)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    allowed = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).isdigit() for t in allowed)
    assert torch.equal(out[1][allowed], logits[1][allowed])
    assert torch.isfinite(logits).all()  # the raw logits (logprobs come from them) are untouched


def test_a_matcher_catches_up_with_the_first_token_sampled_elsewhere(grammars, demo_model):
    tokenizer, vocab = demo_model.tokenizer, demo_model.config.vocab_size
    constraint = StructuredOutput("regex", "(hello world)|(goodbye moon)")
    first = tokenizer.encode("hello")[0]
    structured = StructuredOutputs(grammars)
    out = structured.mask(torch.zeros(1, vocab), [_seq("d", constraint, [first])], in_place=True)
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(out[0]).nonzero().flatten().tolist()}
    assert allowed and all(" world".startswith(text) for text in allowed)
    eos = demo_model.eos_token_ids[0]
    done = _seq("e", constraint, tokenizer.encode("hello world"))
    out = structured.mask(torch.zeros(1, vocab), [done], in_place=True)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [eos]  # complete: only EOS


def test_a_migrated_matcher_starts_after_the_accepted_tokens(grammars, demo_model):
    tokenizer, vocab = demo_model.tokenizer, demo_model.config.vocab_size
    hello = tuple(tokenizer.encode("hello"))
    constraint = StructuredOutput("regex", "(hello world)|(goodbye moon)", accepted=hello)
    assert constraint == StructuredOutput("regex", "(hello world)|(goodbye moon)")  # one cache entry
    out = StructuredOutputs(grammars).mask(torch.zeros(1, vocab), [_seq("m", constraint)], in_place=True)
    allowed = {tokenizer.decode([t]) for t in torch.isfinite(out[0]).nonzero().flatten().tolist()}
    assert allowed and all(" world".startswith(text) for text in allowed)


def test_a_migrated_request_continues_its_constrained_output(demo_model):
    """What a decode migration sends: prompt + the tokens streamed so far, the constraint with them as
    `accepted`; the rest equals the uninterrupted output."""
    engine = make_engine(demo_model, max_model_len=512)
    prompt = _chat(demo_model, "Describe a baker as JSON.")
    params = SamplingParams(max_tokens=80, structured=PERSON_CONSTRAINT)
    engine.add_request("whole", prompt, params)
    whole = run_to_completion(engine)["whole"]
    done = whole[:5]
    moved = SamplingParams(max_tokens=80 - len(done), structured=StructuredOutput("json_schema", PERSON_CONSTRAINT.spec, tuple(done)))
    engine.add_request("moved", prompt + done, moved)
    assert done + run_to_completion(engine)["moved"] == whole
    assert_no_leaked_blocks(engine)


def test_invalid_schema_refused_at_add_request(demo_model):
    engine = make_engine(demo_model, max_model_len=256)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("bad", [1, 2], SamplingParams(structured=StructuredOutput("json_schema", '{"type": 5}')))
    assert err.value.field == "structured_output"
    assert_no_leaked_blocks(engine)


def test_twenty_json_schema_outputs_parse_and_validate(demo_model):
    engine = make_engine(demo_model, max_model_len=512)
    params = SamplingParams(max_tokens=120, structured=PERSON_CONSTRAINT)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", _chat(demo_model, prompt), params)
    tokens = run_to_completion(engine)
    for i in range(len(PROMPTS)):
        ids = tokens[f"r{i}"]
        assert ids[-1] in demo_model.eos_token_ids, "finished by the grammar, not by max_tokens"
        jsonschema.validate(json.loads(demo_model.tokenizer.decode(ids[:-1])), PERSON)
    assert engine.sampler.structured.grammars.misses == 1
    assert_no_leaked_blocks(engine)


def test_sampled_json_object_and_disaggregated_first_token(demo_model):
    """A sampled json_object request; then the same constrained greedy request split across two
    engines (first token on one, the rest on the other) gives the one-engine tokens."""
    engine = make_engine(demo_model, max_model_len=512)
    prompt = _chat(demo_model, "Give me a JSON object about the moon.")
    engine.add_request("s", prompt, SamplingParams(max_tokens=200, temperature=1.0, seed=7,
                                                   structured=StructuredOutput("json_object")))
    greedy = SamplingParams(max_tokens=60, structured=PERSON_CONSTRAINT)
    engine.add_request("g", prompt, greedy)
    tokens = run_to_completion(engine)
    if tokens["s"][-1] in demo_model.eos_token_ids:
        assert isinstance(json.loads(demo_model.tokenizer.decode(tokens["s"][:-1])), dict)
    prefill, decode = make_engine(demo_model, max_model_len=512), make_engine(demo_model, max_model_len=512)
    prefill.add_request("g", prompt, greedy, prefill_only=True)
    first = run_to_completion(prefill)["g"][0]
    layers = prefill.prompt_kv("g")
    prefill.release("g")
    blocks = decode.add_remote_request("g", prompt, greedy).block_ids
    for layer, (k, v) in enumerate(layers):
        decode.kv_cache.write_tokens(layer, blocks, k, v)
    out = decode.accept_first_token("g", Sample(first))
    decode.commit_remote_kv("g")
    assert out.new_token_ids + run_to_completion(decode)["g"] == tokens["g"]
    for e in (engine, prefill, decode):
        assert_no_leaked_blocks(e)


def _chat(demo_model, text: str) -> list[int]:
    from common.tokenization import encode_prompt

    return encode_prompt(demo_model.tokenizer, text)
