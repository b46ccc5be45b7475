"""Under `early`, a prompt whose compute ends before decode's metadata arrives.

Prefill starts computing when its leg arrives (within the early-start
budget); when decode's leg comes late, the whole prompt's KV is computed and
its first token sampled before any destination is known. The finish is then
held (`finish_held` counts it) and `SendHeldKV` sends every chunk and
finishes when the metadata arrives. Real processes: the fault suite's
shared cluster, legs sent by hand so the decode leg can wait.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdcluster.runtime.pd.early_start import early_start_limit
from pdcluster.runtime.spec import Role
from tests.faults.harness import (
    LOAD_SLACK_S,
    FaultCluster,
    gen_body,
    mint_rid,
    mint_room,
    post_leg,
    wait_until,
)
from tests.pd_integration.reference import colocated_outputs

MAX_TOKENS = 4


@pytest.mark.parametrize("length", [40, 1200], ids=["one-chunk", "three-chunks"])
def test_a_prompt_computed_before_decode_paired_it_is_sent_whole_and_equals_colocated(
    pd: FaultCluster, length: int
) -> None:
    rng = random.Random(7)
    prompt = [rng.randrange(1, 256) for _ in range(length)]
    spec = pd.manifest.spec
    prefill = spec.role_spec(Role.prefill)
    assert prefill is not None
    assert (length > prefill.engine.chunk_size) == (length == 1200)
    info = pd.info("prefill-0")
    limit = early_start_limit(
        info["num_total_pages"] * spec.kv_cache.page_size, info["max_prompt_tokens"]
    )
    assert len(prompt) <= limit, "the prompt must start before it is paired"
    expected = colocated_outputs(pd.manifest, [prompt], MAX_TOKENS)[0]
    held_before = pd.stats("prefill-0").get("finish_held", 0)
    body = gen_body(
        prompt, MAX_TOKENS, bootstrap=pd.bootstrap("prefill-0"), rid=mint_rid(), room=mint_room()
    )
    with ThreadPoolExecutor(2) as legs:
        prefill_leg = legs.submit(post_leg, pd.url("prefill-0"), body, 30.0)
        # The prompt computes on its own; its finish waits for decode.
        wait_until(
            lambda: pd.stats("prefill-0").get("finish_held", 0) > held_before,
            # Well inside the bootstrap timeout (6 s) the room waits under.
            min(LOAD_SLACK_S, 0.5 * spec.transfer.bootstrap_timeout_seconds),
            0.01,
            "prefill-0 to finish computing the unpaired prompt",
        )
        assert not prefill_leg.done()  # the leg ends with Success, not before
        decode_leg = post_leg(pd.url("decode-0"), body, 30.0)
        pre = prefill_leg.result()
    assert pre.ok, pre.error
    assert decode_leg.ok, decode_leg.error
    assert decode_leg.output_ids == expected
    assert pd.stats("prefill-0")["finish_held"] == held_before + 1
    pd.assert_clean(["prefill-0", "decode-0"])
