"""Quantized weights: one QuantizationMethod per format, the registry of formats, and the
offline quantizers.

    base.py        QuantizationMethod: the life of a quantized linear (config -> create the
                   weights -> load -> process_weights_after_loading -> apply)
    registry.py    the formats by name, and which one a checkpoint is stored in
    awq.py gptq.py gguf.py                   the linear methods of each format
    quantize.py awq_search.py gptq_quant.py  `tinypaged quantize`: tools that write AWQ / GPTQ
                                             checkpoints (they use the loader; nothing the
                                             loader imports uses them)

Adding a format. Write `quantization/<name>.py` with one subclass of `QuantizationMethod`
(base.py): set `name` to the `quant_method` its checkpoints declare in config.json, read and
check that config in `from_config`, register the stored tensors on each linear in
`create_weights` (this tensor-parallel rank's sizes, with `output_dim` / `input_dim` /
`packed_factor` so the layers' loaders can slice them), repack them in
`process_weights_after_loading` if the kernels want another layout, and compute
x @ W^T + b in `apply`. Its kernels go in `tinypaged/kernels/<name>.py`, each beside its torch
reference. Then add one line to `QUANTIZATION_FORMATS` in registry.py: the loader, EngineConfig's
`quantization` and the CLI's --quantization all read the names there. This package's
`__init__` and registry.py import no torch, so keep the new class out of them.
"""
