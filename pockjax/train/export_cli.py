"""``pockjax export``: compile a LLaMA or MobileNetV2 fine-tuning step for a device with IREE.

Example::

    pockjax export --model smollm2-135m --scheme paper --target arm64 --out out/step-arm64
    pockjax export --model tiny --scheme full --target cpu --out /tmp/step
    pockjax export --model mobilenetv2 --num-classes 10 --image-size 64 --batch-size 8 \
        --target arm64 --out out/mnv2-arm64

MobileNetV2 (``mobilenetv2``: torchvision's ImageNet weights with a fresh
``--num-classes`` head; ``mobilenetv2-tiny``: a random width-0.35 model) exports
the train-mode step of :func:`pockjax.train.classify.classify_train_step`
(BatchNorm batch statistics and running-statistic updates, dropout) with Adam;
its batch inputs are NHWC float32 images (normalised) and int32 labels.

The output directory holds ``module.vmfb``, ``module.json`` and the initial
weights; ``pockjax.runtime.load(dir)`` runs it without JAX.
"""

from __future__ import annotations

import argparse
import time

from pockjax._cli_args import positive_finite_float, positive_int
from pockjax.schemes import ignores_blocks


def register(subparsers) -> None:
    _register_export_model(subparsers)
    from pockjax.backends.iree.targets import names as target_names
    from pockjax.models.llama.mixed import DTYPES, QUANTIZE

    targets = target_names()
    p = subparsers.add_parser(
        "export",
        help="compile a sparse fine-tuning step ahead of time with IREE and write it to a directory",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m, a .gguf / checkpoint path, 'tiny', mobilenetv2 or mobilenetv2-tiny")
    p.add_argument("--scheme", default="paper", help="full, paper, norm-only, channels, lora, or a scheme JSON file")
    p.add_argument("--blocks", type=positive_int, default=None,
                   help="last blocks trained by paper/channels (default: the registry's depth rule,"
                        " see pockjax/schemes.py paper_blocks)")
    p.add_argument("--target", default="cpu", choices=targets, metavar="|".join(targets),
                   help="IREE target (default cpu; see pockjax.backends.iree.targets)")
    p.add_argument("--cpu", default=None, help="IREE CPU name for llvm-cpu targets (e.g. cortex-a76)")
    p.add_argument("--arch", default=None, help="GPU architecture (e.g. sm_80)")
    p.add_argument("--batch-size", type=positive_int, default=1)
    p.add_argument("--seq-len", type=positive_int, default=64)
    p.add_argument("--lr", type=positive_finite_float, default=1e-4)
    p.add_argument("--num-classes", type=positive_int, default=10, help="MobileNetV2: classes of the new head")
    p.add_argument("--image-size", type=positive_int, default=224, help="MobileNetV2: image height and width")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="LLaMA: bf16 computes the matrix products in bfloat16 and holds the frozen weights"
                        " in bfloat16 (IREE cpu and arm64; vulkan has no 16-bit floats for these programs)")
    p.add_argument("--quantize", choices=tuple(QUANTIZE), default="none",
                   help="LLaMA: the frozen matrices travel in the module block-quantized (Q8_0 / Q4_1)")
    p.add_argument("--out", required=True, help="output directory")
    p.set_defaults(func=run_export)


def run_export(args) -> int:
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import llama
    from pockjax.train.schemes import llama_scheme
    from pockjax.train.steps import lm_train_step

    import os

    from pockjax.errors import InputError

    vision = args.model in ("mobilenetv2", "mobilenetv2-tiny")
    unused = ([f for f, given in (("--dtype", args.dtype != "fp32"), ("--quantize", args.quantize != "none"),
                                  ("--seq-len", args.seq_len != 64)) if given] if vision else
              [f for f, given in (("--num-classes", args.num_classes != 10), ("--image-size", args.image_size != 224))
               if given])
    if vision:
        import pockjax.models.mobilenetv2  # noqa: F401  (registers its family's schemes)
    if args.blocks is not None and ignores_blocks(args.scheme, "mobilenetv2" if vision else "llama"):
        unused.append(f"--blocks (--scheme {args.scheme} trains no last blocks)")
    if unused:  # an option that would have no effect
        raise InputError(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not"
                         f" apply to --model {args.model}; leave"
                         f" {'it' if len(unused) == 1 else 'them'} out")
    from pockjax.backends.iree.targets import TARGETS

    gpus = [name for name, (_, _, defaults, _) in TARGETS.items() if "arch" in defaults]  # cuda, vulkan
    gpu = args.target in gpus
    if args.arch and not gpu:
        raise InputError(f"--arch names a GPU architecture (--target {' or '.join(gpus)}), not a CPU of --target"
                         f" {args.target}: name the CPU with --cpu (e.g. --cpu cortex-a76)")
    if args.cpu and gpu:
        cpus = [name for name in TARGETS if name not in gpus]
        raise InputError(f"--cpu names a CPU of --target {', '.join(cpus[:-1])} or {cpus[-1]};"
                         f" --target {args.target} is a GPU:"
                         f" name its architecture with --arch (e.g. --arch sm_80)")
    if args.dtype == "bf16" and args.target == "vulkan":
        raise InputError("--dtype bf16 does not compile for vulkan (IREE's vulkan-spirv has"
                         " no 16-bit floats for these programs); use --dtype fp32, or --quantize int8 to carry the"
                         " frozen weights small")
    if os.path.isdir(args.out) and os.listdir(args.out) and not os.path.exists(os.path.join(args.out, "module.json")):
        raise InputError(f"--out {args.out} holds other files (not an earlier export);"
                         " choose an empty or new directory")
    if vision:
        return _export_mobilenetv2(args)
    if args.model == "tiny":
        model = llama.Llama(llama.LlamaConfig.tiny(), rngs=nnx.Rngs(0))
    else:
        model, _ = llama.load_pretrained(args.model)
    if args.seq_len > model.config.max_seq_len:
        raise InputError(f"--seq-len {args.seq_len} is beyond the model's context of {model.config.max_seq_len}")
    graphdef, params = llama.split(model)
    scheme = llama_scheme(args.scheme, model.config, blocks=args.blocks)
    if args.dtype != "fp32" or args.quantize != "none":
        from pockjax.models.llama.mixed import DTYPES, hold_frozen
        from pockjax.paths import flatten_params

        frozen = scheme.frozen_paths(flatten_params(params), lora_bases=True)  # as finetune holds them
        params = hold_frozen(params, model.config, frozen.__contains__, quantize=args.quantize,
                             dtype=DTYPES[args.dtype])
    if scheme.has_lora:  # the adapters pockjax finetune adds (over held frozen weights too)
        from pockjax.adapters import add_adapters

        params = add_adapters(params, scheme)
    tx = optax.adamw(args.lr)
    train_step = lm_train_step(graphdef, tx)

    options = {k: v for k, v in (("cpu", args.cpu), ("arch", args.arch)) if v}
    step = pockjax.compile(train_step, scheme=scheme, target=args.target, target_options=options,
                           precision="bf16" if args.dtype == "bf16" else None)
    shape = (args.batch_size, args.seq_len)
    batch = (jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.int32), jnp.ones(shape, jnp.float32))
    opt_state = pockjax.init_opt_state(tx, params, scheme)
    t0 = time.perf_counter()
    path = step.export(args.out, params, opt_state, *batch)
    print(f"exported a {args.scheme} step for {args.target} to {path} in {time.perf_counter() - t0:.1f} s")
    return 0


def _export_mobilenetv2(args) -> int:
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import pockjax
    from pockjax.models import mobilenetv2
    from pockjax.train.classify import classify_train_step, resolve_classifier_scheme

    if args.model == "mobilenetv2-tiny":
        config = mobilenetv2.MobileNetV2Config(width_mult=0.35, num_classes=args.num_classes)
        model = mobilenetv2.MobileNetV2(config, rngs=nnx.Rngs(0, dropout=1))
    else:
        model = mobilenetv2.load_pretrained(num_classes=args.num_classes, rngs=nnx.Rngs(0, dropout=1))
    model.train()
    scheme = resolve_classifier_scheme(args.scheme, model.config, blocks=args.blocks)
    optimizer = nnx.Optimizer(model, optax.adam(args.lr), wrt=scheme.nnx_wrt())
    options = {k: v for k, v in (("cpu", args.cpu), ("arch", args.arch)) if v}
    step = pockjax.compile(classify_train_step, scheme=scheme, target=args.target, target_options=options)
    images = jnp.zeros((args.batch_size, args.image_size, args.image_size, 3), jnp.float32)
    labels = jnp.zeros((args.batch_size,), jnp.int32)
    t0 = time.perf_counter()
    path = step.export(args.out, model, optimizer, images, labels)
    print(f"exported a {args.scheme} MobileNetV2 step for {args.target} to {path} in {time.perf_counter() - t0:.1f} s")
    return 0


_EXPORT_MODEL_DOC = """Write a (fine-tuned) LLaMA for llama.cpp (GGUF) or Hugging Face transformers (safetensors).

Example::

    pockjax finetune --scheme lora --lr 1e-3 --out runs/lora
    pockjax export-model --model runs/lora --format gguf --quant q8_0 --out runs/lora.q8_0.gguf
    pockjax export-model --model runs/lora --format safetensors --quant f16 --out runs/lora-hf

GGUF: llama.cpp's tensor names and metadata, the byte-level BPE tokenizer and
its chat template; matrices in f32, f16, q8_0 or q4_0 (norms f32). safetensors:
a Hugging Face LLaMA directory (config.json, model.safetensors, tokenizer.json)
in f32 or f16.
"""


def _register_export_model(subparsers) -> None:
    from pockjax.models.llama.export import EXPORT_FORMATS, GGUF_QUANTS

    p = subparsers.add_parser(
        "export-model", help="write a fine-tuned LLaMA as GGUF (llama.cpp) or a Hugging Face directory",
        description=_EXPORT_MODEL_DOC, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="a pockjax finetune output directory, a Hugging Face LLaMA directory, a .gguf file"
                        " or a model name (smollm2-135m)")
    p.add_argument("--format", choices=EXPORT_FORMATS, default="gguf")
    p.add_argument("--quant", choices=tuple(GGUF_QUANTS), default="f16",
                   help="matrix type: GGUF any; safetensors f32 or f16 (default f16)")
    p.add_argument("--out", required=True, help="the .gguf file, or the directory for safetensors")
    p.set_defaults(func=_run_export_model)


def _run_export_model(args) -> int:
    import os

    from pockjax.models.llama.export import export_model

    from pockjax.errors import InputError

    ext = os.path.splitext(args.out.rstrip(os.sep))[1].lower()
    if args.format == "gguf" and ext in (".safetensors", ".json") and not os.path.isdir(args.out):
        raise InputError(f"--format gguf writes one .gguf file; --out {args.out} names"
                         " a directory or another format (give a .gguf path, or --format safetensors)")
    if args.format == "gguf" and os.path.isfile(args.out) and ext != ".gguf":
        raise InputError(f"--out {args.out} exists and is not a .gguf file; it would"
                         " be overwritten: choose another path")
    if args.format == "safetensors" and ext == ".gguf" and not os.path.isfile(args.out):
        raise InputError(f"--format safetensors writes a Hugging Face directory;"
                         f" --out {args.out} names a file or a .gguf path (give a directory, or --format gguf)")
    t = time.time()
    out = export_model(args.model, args.out, format=args.format, quant=args.quant)
    size = (os.path.getsize(out) if os.path.isfile(out)
            else sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)))
    print(f"wrote {out} ({args.format}, {args.quant}, {size / 1e6:.1f} MB) in {time.time() - t:.1f} s")
    return 0
