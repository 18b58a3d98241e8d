"""What the FP8 and int4 checkpoint parsers (fp8_config.py, int4_config.py) share: the error
that names a `quantization_config` field, the unknown-field check, and the top of a
compressed-tensors config (its keys, status and config_groups), which both formats write alike."""

from __future__ import annotations

from typing import Any

CT_KEYS = {"quant_method", "format", "config_groups", "ignore", "kv_cache_scheme",
           "quantization_status", "global_compression_ratio", "provider", "version",
           "sparsity_config", "transform_config"}
CT_GROUP_KEYS = {"targets", "weights", "input_activations", "output_activations", "format"}


def refuse(field: str, value: Any, why: str) -> None:
    raise ValueError(f"quantization_config.{field}={value!r} is not supported: {why}")


def check_keys(d: dict, where: str, allowed: set[str]) -> None:
    for k in d:
        if k not in allowed:
            refuse(f"{where}{k}", d[k], "unknown field (a quantization detail this loader "
                   "does not know could change the numbers)")


def compressed_tensors_groups(q: dict, group_format: str) -> dict:
    """The checks every compressed-tensors config gets (known keys, 'compressed' status, no KV
    cache / sparsity / transform scheme, at least one group whose keys are known and whose
    format is `group_format` or unset). Returns config_groups."""
    check_keys(q, "", CT_KEYS)
    if q.get("quantization_status", "compressed") != "compressed":
        refuse("quantization_status", q["quantization_status"], "'compressed' only")
    for field in ("kv_cache_scheme", "sparsity_config", "transform_config"):
        if q.get(field):
            refuse(field, q[field], "not implemented")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        refuse("config_groups", groups, "needs at least one group")
    for gname, g in groups.items():
        w = f"config_groups.{gname}."
        check_keys(g, w, CT_GROUP_KEYS)
        if g.get("format") not in (None, group_format):
            refuse(w + "format", g["format"], f"'{group_format}' only")
    return groups
