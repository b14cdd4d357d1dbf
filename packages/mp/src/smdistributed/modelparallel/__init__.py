"""mp's stand-in for ``smdistributed.modelparallel`` (smp v1), so that smp scripts run unchanged:

    import smdistributed.modelparallel.torch as smp   # is mp itself (import mp as smp)

``__version__`` is the smp release whose behaviour mp follows. Where a real smdistributed.modelparallel
is installed too, importing this raises instead of shadowing it (mp.smp_alias, docs/migrating.md).
"""

from mp.smp_alias import SMP_VERSION, install

__version__ = SMP_VERSION

install(__file__)
