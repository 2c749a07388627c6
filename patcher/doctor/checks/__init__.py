"""Doctor's checks, one module per concern. :data:`MODULES` is the one list of them, in report order.

Importing a module registers its checks (readers.base.check); doctor.run imports them in the order of
MODULES. Each check is one function: it reads files, os.environ, /proc or distribution metadata only (never
imports torch, vLLM, exllamav3 or the plugin, never loads a weight, never writes to the pack) and returns
rows. A check says at its registration which packs it is for (``family=``): nothing else lists them.

May import: patch_dsv4.doctor.readers; patch_dsv4.patching, patch_dsv4.tree and patch_dsv4.output (overlay
resolves the names an overlaid file's importers ask for with the engine's resolver; rt.patches reads what a
missing patch does at serve time from the patch itself, Patch.serve_impact).
"""

# (module, whether its checks read only the pack, its config and vLLM's files (run.pack_checks), its concern)
MODULES = (
    ("v41_config", True, "a DeepSeek-V4.1 pack's config, read flattened as vLLM reads it"),
    ("config", True, "config.json and its quantization block"),
    ("shards", True, "the shard files, the index, the links"),
    (
        "experts",
        True,
        "every routed expert present, shaped as the config says, one K per layer; the trellis widths and the "
        "codebook markers",
    ),
    ("backbone", True, "every other tensor vLLM creates, layer by layer, at the top, in the vision tower and draft"),
    ("v41_tensors", True, "a V4.1 pack's kind, its Engram tables, experts and vision tower"),
    ("dense", True, "the weights outside the routed experts, the MTP draft, the delegate"),
    ("model", True, "the model keys against the serving vLLM and flags"),
    ("runtime", False, "the serving interpreter's packages"),
    (
        "v41_serving",
        False,
        "V4.1's serving: DSpark, the EP filter, the topology, the indexer top-k, the streams, FlashInfer",
    ),
    ("v41_engram", False, "the Engram tables against the host's memory"),
    ("overlay", False, "files of vLLM overlaid from another vLLM, and the names their importers lack"),
    ("hooks", False, "sitecustomize, usercustomize and .pth lines that name vllm"),
    ("environ", False, "environment variables and serve flags"),
    ("host", False, "the GPUs, memory, page cache"),
)
