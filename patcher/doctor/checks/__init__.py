"""Doctor's checks, one module per concern; importing one registers its checks, in report order.

doctor.run imports them in the order of its CHECK_MODULES (the pack's, the runtime's, the environment's, the
host's). Each check is one function registered with readers.base.check: it reads files, os.environ, /proc or
distribution metadata only (never imports torch, vLLM, exllamav3 or the plugin, never loads a weight, never
writes to the pack) and returns rows.

    v41_config   a DeepSeek-V4.1 pack's config, read flattened as vLLM reads it
    config       config.json and its quantization block
    shards       the shard files, the index, the links
    v41_tensors  a V4.1 pack's kind, its Engram tables, backbone, experts and vision tower, from the headers
    experts      every routed expert present, shaped as the config says, one K per layer; the trellis
                 widths and the codebook markers
    dense        the weights outside the routed experts, the MTP draft, the delegate
    model        the model keys against the serving vLLM and flags
    runtime      the serving interpreter's packages
    v41_serving  V4.1's serving: DSpark, the EP filter, the topology, the indexer top-k, the streams, FlashInfer
    v41_engram   the Engram tables against the host's memory
    overlay      files of vLLM overlaid from another vLLM, and the names their importers lack
    environ      environment variables and serve flags
    host         the GPUs, memory, page cache

May import: patch_dsv4.doctor.readers; patch_dsv4.patching, patch_dsv4.tree and patch_dsv4.output (overlay
resolves the names an overlaid file's importers ask for with the engine's resolver).
"""
