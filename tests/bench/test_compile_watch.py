"""CompileWatch counts the kernels Triton compiles inside its block, through Triton's JIT hooks
(called here as Triton calls them: there is no GPU to compile on), and puts the hooks back."""

from types import SimpleNamespace

from tinypaged.bench.compile_watch import CompileWatch, triton_knobs

knobs = triton_knobs()  # through tinypaged: importing triton first would break the interpreter


def fake_compile(name: str) -> None:
    """What JITFunction._do_compile does around a compile: the cache hook, then the post hook."""
    args = dict(key=None, repr=name, fn=SimpleNamespace(name=name), compile={},
                is_manual_warmup=False, already_compiled=False)
    assert knobs.runtime.jit_cache_hook(**args) is None  # None: Triton goes on to compile
    knobs.runtime.jit_post_compile_hook(**args)


def test_counts_compiles_by_kernel_and_restores_the_hooks():
    before = (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook)
    with CompileWatch() as watch:
        fake_compile("_lora_shrink_kernel")
        fake_compile("_lora_shrink_kernel")
        fake_compile("_lora_expand_kernel")
    summary = watch.summary()
    assert summary["compiles"] == 3
    assert summary["kernels"] == {"_lora_shrink_kernel": 2, "_lora_expand_kernel": 1}
    assert summary["compile_s"] >= 0
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before


def test_verbose_prints_each_compile(capsys):
    with CompileWatch(verbose=True):
        fake_compile("_dense_gemv_kernel")
    assert "_dense_gemv_kernel" in capsys.readouterr().err
