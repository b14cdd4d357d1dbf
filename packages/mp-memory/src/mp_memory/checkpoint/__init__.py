"""Checkpoint input and output for mp: crash-safe publication, integrity manifests, loading that runs
no code from the file, and smp's file layouts. Free of mp's other packages: the umbrella passes in the
layout, the process groups and the state dicts."""

from mp_memory.checkpoint.background import BackgroundSave
from mp_memory.checkpoint.faults import POINTS, fault_point
from mp_memory.checkpoint.files import load_full, load_partial, save_full, save_partial
from mp_memory.checkpoint.folder import NEWEST, CheckpointFolder, prune, read_newest, save_folder
from mp_memory.checkpoint.layout import Layout, find_parts, manifest_path, part_name
from mp_memory.checkpoint.manifest import Manifest, read_manifest
from mp_memory.checkpoint.publish import PartRecord, remove_stale
from mp_memory.checkpoint.safe_load import TRUST_ENV, is_trusted, load_part

__all__ = [
    "NEWEST",
    "POINTS",
    "TRUST_ENV",
    "BackgroundSave",
    "CheckpointFolder",
    "Layout",
    "Manifest",
    "PartRecord",
    "fault_point",
    "find_parts",
    "is_trusted",
    "load_full",
    "load_part",
    "load_partial",
    "manifest_path",
    "part_name",
    "prune",
    "read_manifest",
    "read_newest",
    "remove_stale",
    "save_folder",
    "save_full",
    "save_partial",
]
