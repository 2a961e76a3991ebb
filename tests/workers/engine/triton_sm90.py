"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, in the launch
configurations the triton backend uses. The interpreter skips the compiler's checks (tl.dot's smallest
tile, operand dtypes, shared memory), so this is what catches a kernel that runs only on the CPU.

Run as its own process (`python -m tests.workers.engine.triton_sm90`): with TRITON_INTERPRET set, the
kernels would be decorated for the interpreter and could not be compiled.
"""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from workers.engine.attention import triton_kernels as kernels

SM90 = GPUTarget("cuda", 90, 32)
# SmolLM2-135M's layout: 9 query heads on 3 KV heads, head_dim 64, blocks of 16.
SHAPE = {"HEAD_DIM": 64, "BLOCK_SIZE": 16, "BLOCK_D": 64}


def compile_kernel(fn: triton.JITFunction, pointers: dict[str, str], constants: dict[str, object]) -> None:
    """Every argument not named is an int32 scalar, except the softmax scale."""
    scalars = {"qk_scale": "fp32"}
    signature = {
        name: "constexpr" if name in constants else pointers.get(name) or scalars.get(name, "i32")
        for name in fn.arg_names
    }
    triton.compile(ASTSource(fn, signature, constants), target=SM90)


def attention_pointers(dtype: str, split: bool) -> dict[str, str]:
    cache = {name: f"*{dtype}" for name in ("q_ptr", "k_cache_ptr", "v_cache_ptr")}
    return cache | {
        "block_tables_ptr": "*i32",
        "items_ptr": "*i32",
        "out_ptr": "*fp32" if split else f"*{dtype}",
        "lse_ptr": "*fp32",
    }


def main() -> None:
    attention = {"GROUP": 3, "BLOCK_N": 64} | SHAPE
    # bf16 in every launch shape (chunk tile, decode, split decode); fp32 (IEEE products) in the largest.
    launches = [
        ("bf16", "tf32", 16, 4, False),
        ("bf16", "tf32", 1, 16, False),
        ("bf16", "tf32", 1, 16, True),
        ("fp32", "ieee", 16, 4, False),
    ]
    for dtype, precision, block_q, block_g, split in launches:
        launch = {"BLOCK_Q": block_q, "BLOCK_G": block_g, "SPLIT": split, "DOT_PRECISION": precision}
        compile_kernel(kernels.paged_attention_kernel, attention_pointers(dtype, split), attention | launch)
    store = {name: "*bf16" for name in ("k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr")}
    compile_kernel(
        kernels.store_kv_kernel, store | {"slots_ptr": "*i64"}, {"NUM_KV_HEADS": 3, "BLOCK_H": 4} | SHAPE
    )
    merge = {"partial_ptr": "*fp32", "lse_ptr": "*fp32", "items_ptr": "*i32", "out_ptr": "*bf16"}
    compile_kernel(kernels.merge_splits_kernel, merge, {"HEAD_DIM": 64, "BLOCK_S": 16, "BLOCK_D": 64})
    print("compiled for sm_90")


if __name__ == "__main__":
    main()
