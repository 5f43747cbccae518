"""BRIGADE_MODEL's served models: `[id=]artifact`, comma-separated, the default first; an
engine worker serves one of them (BRIGADE_ENGINE_MODEL)."""

from __future__ import annotations

import pytest

from schemas import models, settings
from schemas.models import ServedModel


def test_a_list_of_models_with_and_without_ids():
    env = {"BRIGADE_MODEL": "smollm2-135m, tiny=/models/tiny ,/m/x.gguf"}
    assert models.served(env) == (
        ServedModel("smollm2-135m", "smollm2-135m"),
        ServedModel("tiny", "/models/tiny"),
        ServedModel("/m/x.gguf", "/m/x.gguf"),  # its path is its id, as vLLM names it
    )
    assert models.default(env).id == "smollm2-135m"
    assert models.served({}) == (ServedModel("smollm2-135m", "smollm2-135m"),)
    served = models.served(env)
    assert models.find(served, None) is served[0]
    assert models.find(served, "tiny") is served[1] and models.find(served, "gpt-4o") is None


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a,a", "'a' and 'a' share the id 'a'"),
        ("a=x,a=y", "share the id 'a'"),
        ("=x", "allowed: comma-separated `model` or `id=model`"),
        (",", "allowed: comma-separated"),
    ],
)
def test_a_bad_list_names_the_variable_and_the_problem(text: str, problem: str):
    with pytest.raises(settings.InvalidSetting) as info:
        models.served({"BRIGADE_MODEL": text})
    assert info.value.name == "BRIGADE_MODEL" and problem in str(info.value)


def test_two_ids_that_would_share_a_subject_token_are_refused():
    tokenish = models.ServedModel("a.b", "x").token  # a slug plus its digest
    with pytest.raises(settings.InvalidSetting, match="share the subject token"):
        models.served({"BRIGADE_MODEL": f"a.b=x,{tokenish}=y"})


def test_an_engine_worker_serves_one_listed_model():
    env = {"BRIGADE_MODEL": "smollm2-135m,tiny=/models/tiny"}
    assert models.engine_model(env).id == "smollm2-135m"  # unset: the first
    assert models.engine_model({**env, "BRIGADE_ENGINE_MODEL": "tiny"}).artifact == "/models/tiny"
    with pytest.raises(settings.InvalidSetting) as info:
        models.engine_model({**env, "BRIGADE_ENGINE_MODEL": "other"})
    assert info.value.name == "BRIGADE_ENGINE_MODEL"
    assert "not an id of BRIGADE_MODEL (smollm2-135m, tiny)" in str(info.value)
