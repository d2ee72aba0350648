"""A kernel the Triton interpreter runs but the GPU compiler rejects (``break`` in a loop is plain
Python to the interpreter, unsupported by Triton's code generator): the negative control of
tests/test_gpu_compile.py."""
import triton
import triton.language as tl


@triton.jit
def _loop_with_break_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, n):
        if k == 2:
            break
        acc += tl.load(x_ptr + k * BLOCK + i)
    tl.store(y_ptr + i, acc)


@triton.jit
def _copy_rows_kernel(x_ptr, y_ptr, n_cols, BLOCK: tl.constexpr):
    """y[r, :] = x[r, :] (bytes): vector loads when the compiler knows x and n_cols are 16-aligned, byte
    loads when it does not -- the specialization tests of tests/test_gpu_compile.py."""
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    m = c < n_cols
    tl.store(y_ptr + r * n_cols + c, tl.load(x_ptr + r * n_cols + c, mask=m), mask=m)
