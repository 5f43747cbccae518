"""The served models: what BRIGADE_MODEL names, parsed once, torch-free.

BRIGADE_MODEL is a comma-separated list of `[id=]artifact`: the artifact is a registered name, a
.gguf file or a Hugging Face directory, and the id is what clients send in `model` (without
`id=`, the artifact's text itself, as vLLM names a model by its path). The first is the default,
for a request that names none. Each engine worker serves exactly one of them
(BRIGADE_ENGINE_MODEL, else the first) and announces it in its heartbeat; the gateway refuses a
model that is not listed (`model_not_found`); the tokenize, context and detokenize stages use
the request's model's tokenizer and chat template.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from schemas import settings, subjects


@dataclass(frozen=True)
class ServedModel:
    id: str  # the name clients send in `model` and /v1/models lists
    artifact: str  # a registered name, a .gguf file or a Hugging Face directory

    @property
    def token(self) -> str:
        """Its subject token: `tokenized` events for it travel on llm.ev.<id>.tokenized.<token>."""
        return subjects.model_token(self.id)


def parse_one(text: str) -> ServedModel:
    """`id=artifact` or `artifact` (its own id). ValueError when a side is empty."""
    name, sep, artifact = (part.strip() for part in text.partition("="))
    if not sep:
        if not name:
            raise ValueError("an empty model")
        return ServedModel(name, name)
    if not name or not artifact:
        raise ValueError(f"{text.strip()!r}: give `id=artifact`, both sides non-empty")
    return ServedModel(name, artifact)


def parse(text: str) -> tuple[ServedModel, ...]:
    """A comma-separated list; ValueError on an empty one or an id (or subject token) twice."""
    found = tuple(parse_one(part) for part in text.split(",") if part.strip())
    if not found:
        raise ValueError("no model named")
    for key, what in ((lambda m: m.id, "id"), (lambda m: m.token, "subject token")):
        seen: dict[str, ServedModel] = {}
        for model in found:
            other = seen.setdefault(key(model), model)
            if other is not model:
                raise ValueError(
                    f"{other.id!r} and {model.id!r} share the {what} {key(model)!r}; name them "
                    "apart with `id=artifact`"
                )
    return found


def served(environ: Mapping[str, str] | None = None) -> tuple[ServedModel, ...]:
    """Every model this deployment serves (BRIGADE_MODEL), the default first."""
    text = settings.MODEL.get(environ)
    try:
        return parse(text)
    except ValueError as err:
        raise settings.InvalidSetting(settings.MODEL, text, str(err)) from None


def default(environ: Mapping[str, str] | None = None) -> ServedModel:
    return served(environ)[0]


def find(models: tuple[ServedModel, ...], name: str | None) -> ServedModel | None:
    """The served model of id `name` (None: the default), else None."""
    if name is None:
        return models[0]
    return next((m for m in models if m.id == name), None)


def not_served(name: str | None, served_models: tuple[ServedModel, ...]) -> str:
    """Why a request for `name` is refused (`model_not_found`), naming what is served."""
    ids = ", ".join(m.id for m in served_models)
    return f"the model {(name or '')[:100]!r} is not served here; served: {ids}"


def engine_model(environ: Mapping[str, str] | None = None) -> ServedModel:
    """The one model this engine worker serves: BRIGADE_ENGINE_MODEL, an id of BRIGADE_MODEL
    (a worker of a model the pipeline does not list would get no request); unset, the first."""
    served_models = served(environ)
    text = settings.ENGINE_MODEL.get(environ)
    if text is None:
        return served_models[0]
    found = find(served_models, text.strip())
    if found is None:
        ids = ", ".join(m.id for m in served_models)
        raise settings.InvalidSetting(
            settings.ENGINE_MODEL, text, f"not an id of BRIGADE_MODEL ({ids})"
        )
    return found
