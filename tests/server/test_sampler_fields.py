"""Sampler settings per request: top-level fields of SamplerConfig on both routes, passed down to generation."""

from __future__ import annotations

import dataclasses
from typing import Any

try:  # the openai 3.x client ships httpx as `httpx2`
    import httpx2 as httpx
except ImportError:
    import httpx
import pytest

import diffgemma.session.pipeline as pipeline_module
from diffgemma.config import SamplerConfig
from diffgemma.engine.generate import GenerateOutput
from diffgemma.server.schema import REFUSED_FIELDS, SamplerFields
from tests.server.conftest import MODEL, drive_at_begin

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
BODIES = {
    CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 64},
    COMP: {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 64},
}


@pytest.fixture
def runs(monkeypatch) -> list[tuple[SamplerConfig, GenerateOutput]]:
    """Each generation's sampler config and output, from the real block loop."""
    seen: list[tuple[SamplerConfig, GenerateOutput]] = []
    real = pipeline_module.drive

    def spy(turn, *args, **kwargs) -> GenerateOutput:
        out = real(turn, *args, **kwargs)
        seen.append((turn.cfg, out))
        return out

    drive_at_begin(monkeypatch, spy)
    return seen


def post(server, path: str, **fields: Any) -> httpx.Response:
    return httpx.post(server.base + path, json={**BODIES[path], **fields}, timeout=30)


def test_the_fields_are_the_configs_own_less_what_the_server_owns() -> None:
    config = {f.name: f.type for f in dataclasses.fields(SamplerConfig)}
    assert set(SamplerFields.model_fields) == set(config) - set(REFUSED_FIELDS)
    types = {"bool": bool, "int": int, "float": float}
    for name, info in SamplerFields.model_fields.items():
        assert info.annotation == types[config[name]] | None, name


@pytest.mark.parametrize("path", [CHAT, COMP])
def test_one_denoise_step_a_block(server, runs, path) -> None:
    assert post(server, path, seed=3).status_code == 200
    (default, before) = runs[-1]
    assert default is server.app.state.registry.engine.sampler  # no sampler fields: the engine's own
    assert before.steps > before.blocks  # the test engine takes up to 4 steps a block
    assert post(server, path, seed=3, max_denoising_steps=1, empty_reply_retry=0).status_code == 200
    cfg, out = runs[-1]
    assert cfg.max_denoising_steps == 1 and cfg.empty_reply_retry == 0
    assert out.steps == out.blocks and out.blocks > 0
    assert post(server, path, seed=3).status_code == 200  # and the next request is the server's again
    assert runs[-1][0] is default and runs[-1][1].token_ids == before.token_ids


def test_every_field_reaches_the_sampler(server, runs) -> None:
    engine = server.app.state.registry.engine
    fields = dict(
        entropy_bound=0.2,
        max_denoising_steps=3,
        t_min=0.1,
        t_max=0.9,
        stability_threshold=2,
        confidence_threshold=0.01,
        denoiser_argmax=False,
        first_step_sc_seed=False,
        plateau_steps=0,
        plateau_mean_entropy=0.1,
        pad_gate=False,
        canvas_shrink=True,
        sc_sparse=False,
        entropy_stop=0,  # an integer for a float field is a number
        entropy_stop_min_steps=2,
        empty_reply_retry=1,
        commit_conf_trim=0.5,
        pad_block_stop=False,
    )
    assert set(fields) == set(SamplerFields.model_fields)
    for path in (CHAT, COMP):
        assert post(server, path, **fields).status_code == 200
        assert runs[-1][0] == engine.sampler.replace(**fields)


def test_only_a_request_with_sampler_fields_passes_a_sampler(server) -> None:
    import json

    from diffgemma.session import ops as O

    def generates() -> list[O.Generate]:
        lines = server.app.state.op_log_path.read_text().splitlines()
        ops = [json.loads(line)["op"] for line in lines if line.startswith('{"op"')]
        return [O.from_json(op, O.OPS) for op in ops if op["type"] == "Generate"]

    before = len(generates())
    assert post(server, COMP, max_tokens=8, entropy_bound=None).status_code == 200  # null: left out
    assert post(server, COMP, max_tokens=8, entropy_bound=0.3).status_code == 200
    server.check_registry()
    first, second = generates()[before:]
    pipeline = server.app.state.pipeline
    assert first.sampler is None
    assert pipeline.sampler(second.sampler) == pipeline.engine.sampler.replace(entropy_bound=0.3)


BAD = [
    ("entropy_bound", "low", "valid number"),
    ("max_denoising_steps", 2.5, "valid integer"),
    ("denoiser_argmax", 1, "valid boolean"),
    ("t_min", 0.9, "need 0 <= t_min < t_max"),  # the server's t_max is 0.8
    ("t_max", 0.2, "need 0 <= t_min < t_max"),  # and its t_min 0.4
    ("commit_conf_trim", 1.5, "commit_conf_trim must be in [0, 1)"),
    ("plateau_steps", -1, "plateau_steps must be >= 0"),
    ("entropy_bound", 0, "entropy_bound must be > 0"),
    ("max_denoising_steps", 10**6, "less than or equal to 512"),
    ("plateau_steps", 10**30, "less than or equal to 512"),  # was an OverflowError in the stop rules
]


@pytest.mark.parametrize("path", [CHAT, COMP])
@pytest.mark.parametrize(("name", "value", "why"), BAD)
def test_a_bad_value_is_a_400_naming_the_field(server, path, name, value, why) -> None:
    r = post(server, path, **{name: value})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == name and why in error["message"], error


def test_a_rule_over_two_fields_names_the_first_of_its_fields_the_request_set(server) -> None:
    r = post(server, COMP, t_max=0.3, t_min=0.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "t_min"
    r = post(server, COMP, t_max=0.3)  # below the server's t_min
    assert r.status_code == 400 and r.json()["error"]["param"] == "t_max"
    assert post(server, COMP, t_min=0.85, t_max=0.9, max_tokens=4).status_code == 200  # valid together


@pytest.mark.parametrize("name", sorted(REFUSED_FIELDS))
def test_fields_the_server_owns_are_refused(server, name) -> None:
    """`stop_token_ids`, `pad_token_id` and `max_new_tokens` are a 400 (not silently ignored): the model's stop
    tokens and pad id are its own, and `max_tokens` governs the length."""
    for path in (CHAT, COMP):
        r = post(server, path, **{name: [1] if name == "stop_token_ids" else 5})
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == name and "not accepted" in error["message"]
        assert post(server, path, max_tokens=4, **{name: None}).status_code == 200  # null: left out
