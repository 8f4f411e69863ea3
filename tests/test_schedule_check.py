"""The GPU tests' check of a compiled side-stream program's schedule
(tests/gpu/gpu_helpers.assert_side_results_read_after_join) on small HLO texts written as XLA prints a
scheduled module: what it accepts and what it refuses."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent / "gpu"))
from gpu_helpers import assert_side_results_read_after_join  # noqa: E402

HEAD = """HloModule jit_step, is_scheduled=true

%fused_sum (p: s32[8]) -> s32[] {
  %p = s32[8]{0} parameter(0)
  ROOT %r = s32[] reduce(%p, %p), dimensions={0}, to_apply=%add
}

%wrapped_join (a: bf16[4,8], b: s32[8]) -> s32[1] {
  %a = bf16[4,8]{1,0} parameter(0)
  %b = s32[8]{0} parameter(1)
  ROOT %j = s32[1]{0} custom-call(%a, %b), custom_call_target="jax_ep_side_join"
}

ENTRY %main.1_spmd (x: bf16[4,8], m: f32[4,8]) -> (s32[], f32[4,8]) {
  %x = bf16[4,8]{1,0} parameter(0)
  %m = f32[4,8]{1,0} parameter(1)
  %side = (bf16[4,8]{1,0}, s32[8]{0}) custom-call(%x), custom_call_target="jax_ep_dispatch_side"
  %rows = bf16[4,8]{1,0} get-tuple-element(%side), index=0
  %sizes = s32[8]{0} get-tuple-element(%side), index=1
  %barrier = (f32[4,8]{1,0}, bf16[4,8]{1,0}) tuple(%m, %rows)
  %fn_in = f32[4,8]{1,0} get-tuple-element(%barrier), index=0
  %fn = f32[4,8]{1,0} fusion(%fn_in), kind=kLoop, calls=%fused_tanh
"""
JOIN = '  %join = s32[1]{0} custom-call(%rows, %sizes, %fn), custom_call_target="jax_ep_side_join"\n'
WRAPPED_JOIN = "  %join = s32[1]{0} fusion(%rows, %sizes), kind=kCustom, calls=%wrapped_join\n"
TAIL = """  %after = (bf16[4,8]{1,0}, s32[8]{0}, s32[1]{0}) tuple(%rows, %sizes, %join)
  %sizes2 = s32[8]{0} get-tuple-element(%after), index=1
  %total = s32[] fusion(%sizes2), kind=kInput, calls=%fused_sum
  ROOT %out = (s32[], f32[4,8]{1,0}) tuple(%total, %fn)
}
"""
EARLY_READ = "  %early = s32[] fusion(%sizes), kind=kInput, calls=%fused_sum\n"
EP_CALL = '  %other = bf16[4,8]{1,0} custom-call(%x), custom_call_target="jax_ep_combine"\n'


@pytest.mark.parametrize("join", [JOIN, WRAPPED_JOIN], ids=["join", "join_in_a_fusion"])
def test_readers_after_the_join_pass(join):
    assert_side_results_read_after_join(HEAD + join + TAIL, "ok")


def test_a_read_before_the_join_is_refused():
    with pytest.raises(AssertionError, match=r"%early \(fusion\) reads \['sizes'\] of side call %side"):
        assert_side_results_read_after_join(HEAD + EARLY_READ + JOIN + TAIL, "early")


def test_an_ep_call_before_the_join_is_refused():
    with pytest.raises(AssertionError, match="EP call %other is issued on XLA's stream between side call"):
        assert_side_results_read_after_join(HEAD + EP_CALL + JOIN + TAIL, "ep call")


def test_a_side_call_without_a_join_is_refused():
    with pytest.raises(AssertionError, match="side call %side has no join after it"):
        assert_side_results_read_after_join(HEAD + "  ROOT %out = f32[4,8]{1,0} copy(%fn)\n}\n", "no join")


def test_a_program_without_a_side_call_is_refused():
    with pytest.raises(AssertionError, match="no side call"):
        plain = HEAD.replace("jax_ep_dispatch_side", "jax_ep_dispatch")
        assert_side_results_read_after_join(plain + JOIN + TAIL, "plain")
