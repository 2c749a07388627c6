"""What doctor's checks read, and what they are made of.

    files        regular files read bounded, values echoed clipped, JSON sized before it is parsed
    base         the rows doctor prints, the context every check reads, the check registry
    family       which DeepSeek a pack is, and V4.1's nested config flattened as vLLM reads it
    source       where a pack's files come from: a local directory, or a repository on the Hub
    hub          a pack on the Hugging Face Hub, read by HTTP range requests (the optional extra), and
                 open_source: the source --pack names
    pack         the pack, read once: the shards' headers summarised, what config.json declares
    v41_scan     what the V4.1 rows read of the headers
    safetensors  safetensors shard headers, and single marker tensors, read without loading a payload
    serving_env  what doctor reads of the serving environment, without importing any of it

May import: patch_dsv4.output (the errors a reader raises); nothing else of the package outside this folder.
"""
