"""SkyRL 0.4.0's own ``RemoteGenerateClient`` (code no one here wrote, imported from its wheel) against
``python -m r3jax serve`` (a subprocess) over a multi-turn conversation, accumulating routes with SkyRL's own
``RoutedExpertTrace``: the same tokens, logprobs and route rows as r3jax's client and trace. And
SkyRL's own route decoder and encoder against r3jax's, both directions, for E = 384."""

from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from r3jax import routes as routes_lib
from r3jax.engine import GenerateRequest
from r3jax.serve import RemoteInferenceClient
from r3jax.serve.peers import skyrl
from r3jax.trace import RoutedExpertTrace

# one decode bucket and one prefill row (2 + 64 tokens a step): 2 programs to compile
ARGS = ("--max-batch-size", "2", "--max-seq-len", "64", "--decode-buckets", "1", "--max-num-batched-tokens", "66")  # test_cluster.py's servers: the same cached programs
# SkyRL's default vLLM sampling params (inference_servers/engine_utils.py get_vllm_sampling_params),
# greedy so both clients see the same tokens
SKYRL_SAMPLING = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                  "max_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1,
                  "stop": None}
PROMPT, OBSERVATIONS = [256, 259, 50, 43, 50, 260], ([257, 259, 51, 260], [257, 259, 52, 53, 260])


@pytest.fixture(scope="module")
def served(serve_helpers, request, tmp_path_factory):
    """``python -m r3jax serve --model tiny`` in a subprocess: what SkyRL users would start."""
    store = getattr(request.config, "cache", None)
    cache = store.mkdir("r3jax-serve-jax-cache") if store else tmp_path_factory.mktemp("jax-cache")
    port = serve_helpers.free_port()
    proc = serve_helpers.start_process(port, *ARGS, cache_dir=cache)
    url = f"http://127.0.0.1:{port}"
    try:
        serve_helpers.wait_healthy(url, timeout=240, proc=proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def test_skyrls_own_client_over_a_multi_turn_conversation(served, skyrl_client):
    ric, _, sky_routes = skyrl_client
    url = served

    # SkyRL's client is async; drive the same three turns with it and with r3jax's own client
    async def run_skyrl():
        client, trace = ric.RemoteGenerateClient(proxy_url=url), sky_routes.RoutedExpertTrace()
        tokens, outs = list(PROMPT), []
        for turn in range(3):
            s = trace.prompt_start
            res = await client.generate(prompt_token_ids=list(tokens), sampling_params=SKYRL_SAMPLING,
                                        session_id="traj-7", model="tiny", return_routed_experts=True,
                                        routed_experts_prompt_start=s)
            trace.record_generation(prompt_token_count=len(tokens), generated_token_count=len(res.response_ids),
                                    routed_experts=res.routed_experts)
            outs.append((res.response_ids, res.response_logprobs, res.routed_experts, s, res.stop_reason))
            tokens += list(res.response_ids) + (list(OBSERVATIONS[turn]) if turn < 2 else [])
        await client.aclose()
        return tokens, outs, trace

    sky_tokens, sky_outs, sky_trace = asyncio.run(run_skyrl())

    ours, tokens = RoutedExpertTrace(moe_layer_ids=(1, 2)), list(PROMPT)  # the tiny model's MoE layers
    with RemoteInferenceClient(url) as client:
        for turn, (ids, lps, routes, s, stop) in enumerate(sky_outs):
            req = GenerateRequest(list(tokens), max_tokens=5, temperature=0.0, return_routed_experts=True,
                                  routed_experts_prompt_start=ours.prompt_start)
            [out] = client.generate([req])
            assert s == ours.prompt_start
            assert list(ids) == out.output_ids and list(lps) == out.logprobs and stop == out.finish_reason
            assert routes.dtype == np.uint8  # SkyRL's canonical dtype for ids < 256
            np.testing.assert_array_equal(routes, out.routed_experts)
            ours = ours.record(prompt_len=len(tokens), generated_len=len(out.output_ids), routes=out.routed_experts)
            tokens += out.output_ids + (list(OBSERVATIONS[turn]) if turn < 2 else [])
    assert tokens == sky_tokens
    n = len(tokens)
    sky_final = sky_trace.finalize(token_count=n, loss_mask=[0] * n)
    routes, captured = ours.finalize(token_count=n, loss_mask=np.zeros(n, np.float32))
    assert sky_final.shape[0] == int(captured.sum()) == ours.prompt_start
    np.testing.assert_array_equal(sky_final, routes[:ours.prompt_start])
    stats = httpx.get(url + "/v1/stats").json()
    assert stats["sessions"]["traj-7"] == 3 and stats["protocols"]["skyrl"] >= 3


def _chunk(rows: int, hi: int, l: int = 3, k: int = 8) -> np.ndarray:
    rng = np.random.default_rng(rows + hi)
    if rows == 0:
        return np.zeros((0, l, k), np.int16)
    return np.stack([rng.permutation(hi)[:k] for _ in range(rows * l)]).reshape(rows, l, k).astype(np.int16)


@pytest.mark.parametrize("rows,hi", [(0, 384), (5, 256), (5, 384), (1, 300)])
def test_skyrls_own_route_codec_and_ours_read_each_other_for_e384(skyrl_client, rows, hi):
    _, wire, _ = skyrl_client
    chunk = _chunk(rows, hi)
    theirs = wire.pack_routed_experts(chunk)  # SkyRL's own server-side packer
    ours = skyrl.encode_routes(chunk, 384)  # what /skyrl/v1/generate sends
    decoded = wire.decode_packed_routed_experts(ours)  # SkyRL's decoder accepts it
    np.testing.assert_array_equal(decoded, chunk)
    assert theirs == ours  # byte for byte what SkyRL's own server packs
    for decode in (lambda p: skyrl.decode_routes(p, 384), lambda p: routes_lib.decode(p, 384)):
        got = decode(theirs)
        assert got.dtype == np.int16 and got.shape == chunk.shape  # r3jax's dtype for E = 384
        np.testing.assert_array_equal(got, chunk)
    native = {k: v for k, v in routes_lib.encode(chunk, 0, [1, 2, 3]).items() if k in ("data", "shape", "dtype")}
    if rows == 0 or hi <= 256:  # r3jax's native form (int16 by E) is not canonical here: SkyRL refuses it
        with pytest.raises(ValueError, match="non-canonical dtype int16; expected uint8"):
            wire.decode_packed_routed_experts(native)
    else:
        np.testing.assert_array_equal(wire.decode_packed_routed_experts(native), chunk)
