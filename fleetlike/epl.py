"""``fleetlike.epl``: EPL's ``Config`` / ``init`` under the name EPL's scripts import (``import epl``).

The module lives in `fleetlike.fleet.epl`; importing this name binds it to the same module
object, so nothing is defined twice.
"""

import sys

from fleetlike.fleet import epl as _module

sys.modules[__name__] = _module
