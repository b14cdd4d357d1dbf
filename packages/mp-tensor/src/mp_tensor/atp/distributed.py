"""``atp.distributed``: the paper's mesh API (its Figure 9), ``init_mesh((d1, d2))``.

The mesh that :func:`init_mesh` creates becomes the *current mesh*, which ATP modules built without an
explicit ``mesh=`` use, as in the paper's example. This default is the only state ATP keeps; code that
manages several meshes passes them explicitly and need not call :func:`init_mesh`.
"""

from __future__ import annotations

from collections.abc import Sequence

from mp_tensor.atp.errors import MeshError
from mp_tensor.atp.mesh import DeviceMesh, create_mesh

__all__ = ["DeviceMesh", "destroy_mesh", "get_mesh", "init_mesh", "set_mesh"]


class _Current:
    mesh: DeviceMesh | None = None


def init_mesh(shape: Sequence[int] | int, groups: Sequence[Sequence[int]] | None = None) -> DeviceMesh:
    """Create ``DeviceMesh(shape)`` over the tensor-parallel ``groups`` (default: all ranks); make it current.

    Collective over the default group; see :func:`mp_tensor.atp.mesh.create_mesh`.
    """
    mesh = create_mesh(shape, groups)
    set_mesh(mesh)
    return mesh


def set_mesh(mesh: DeviceMesh | None) -> None:
    """Make ``mesh`` the current mesh (``None`` clears it)."""
    _Current.mesh = mesh


def get_mesh(mesh: DeviceMesh | None = None) -> DeviceMesh:
    """``mesh`` if given, else the current mesh; raises :class:`MeshError` when there is none."""
    if mesh is not None:
        return mesh
    if _Current.mesh is None:
        raise MeshError(
            "no device mesh: pass mesh= to the ATP module, or call atp.distributed.init_mesh((d1, d2)) first."
        )
    return _Current.mesh


def destroy_mesh() -> None:
    """Destroy the current mesh's process groups and clear it."""
    if _Current.mesh is not None:
        _Current.mesh.destroy()
        _Current.mesh = None
