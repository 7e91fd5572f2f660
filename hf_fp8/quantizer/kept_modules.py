"""A pre-quantized checkpoint's high-precision layer that its config does not skip.

When ``config.json``'s ``modules_to_not_convert`` lost a layer the checkpoint kept in high
precision (``lm_head`` most often), the quantizer builds an ``Fp8Linear`` for it and the
stored float weight is refused as "not fp8". This names the actual fix: the layer has no
``weight_scale`` in the checkpoint, so it was kept on purpose; put it back in the list.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hf_fp8.utils.folders import read_index_json
from hf_fp8.utils.safetensors_header import tensor_dtypes


def stored_names(root: str) -> set[str] | None:
    """The tensor names of the local checkpoint folder ``root`` (its index's weight map, or
    ``model.safetensors``' header); ``None`` when they cannot be read (a Hub id …)."""
    if not root or not os.path.isdir(root):
        return None
    index = os.path.join(root, "model.safetensors.index.json")
    single = os.path.join(root, "model.safetensors")
    if os.path.isfile(single):
        dtypes = tensor_dtypes(single)
        return None if dtypes is None else set(dtypes)
    try:
        index_json = read_index_json(index)  # size-capped; ValueError names the file
    except (OSError, ValueError):
        return None
    weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
    return set(weight_map) if isinstance(weight_map, dict) else None


def file_tensor_names(files: Sequence[str]) -> set[str] | None:
    """The tensor names stored in the checkpoint ``files`` transformers reads (the headers of
    its ``.safetensors`` shards): what the checkpoint holds, wherever its layers are placed
    (a disk-offloaded layer's tensors never reach its module). ``None`` when there are none
    or a file is not a readable safetensors file (``.bin``)."""
    names: set[str] = set()
    for file in files:
        dtypes = tensor_dtypes(file) if str(file).endswith(".safetensors") else None
        if dtypes is None:
            return None
        names.update(dtypes)
    return names if files else None


def holds_no_fp8(files: Sequence[str]) -> bool:
    """The checkpoint ``files`` (``.safetensors``) store no fp8 tensor and no weight scale:
    all-float weights. ``False`` when a file cannot be read."""
    if not files:
        return False
    for file in files:
        dtypes = tensor_dtypes(file) if str(file).endswith(".safetensors") else None
        if dtypes is None:
            return False
        if any(str(d).startswith("F8_") for d in dtypes.values()):
            return False
        if any(n.endswith(("weight_scale", "weight_scale_inv")) for n in dtypes):
            return False
    return True


def skip_list_hint(
    key: str, root: str, skip: Sequence[str] | None, files: Sequence[str] = ()
) -> str | None:
    """For a high-precision ``<module>.weight`` found where FP8 codes were expected: the
    message naming the missing ``modules_to_not_convert`` entry when the checkpoint stores no
    ``<module>.weight_scale`` (the layer was kept in high precision), else ``None``. When the
    checkpoint ``files`` hold no FP8 tensor at all, the config's quantization_config is wrong,
    not its skip list: the message says to remove it (R39 F6)."""
    module = key.rpartition(".")[0]
    config = os.path.join(root, "config.json") if root else "its config.json"
    if module and holds_no_fp8(files):
        return (
            f"{key}: stored in high precision, and the checkpoint stores no FP8 tensor at all "
            "(no fp8 weight, no weight_scale): its weights are high precision, but "
            f"{config} has an hf_fp8 quantization_config, which says they are FP8. Remove "
            f'"quantization_config" from {config} to load the high-precision model; to '
            "quantize it, remove it and load with from_pretrained(..., "
            "quantization_config=Fp8Config(...)) (a config passed while config.json has one "
            "is not used)"
        )
    names = stored_names(root)
    if not module or names is None or f"{module}.weight_scale" in names:
        return None
    leaf = module.rpartition(".")[2]
    return (
        f"{key}: stored in high precision, with no {module}.weight_scale: the checkpoint kept "
        f"{module} unquantized, but quantization_config.modules_to_not_convert "
        f"({list(skip or [])}) in {config} does not list it. Put it back: add {leaf!r} to "
        "that list (save_pretrained writes the layers it kept)"
    )
