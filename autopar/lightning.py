"""``from autopar.lightning import AutoparStrategy``: Lightning Fabric's strategy (autopar/integrations/lightning.py).

Importing it registers ``Fabric(strategy="autopar")``. Needs ``pip install "autopar[lightning]"``.
"""

from autopar.integrations.lightning import AutoparStrategy

__all__ = ["AutoparStrategy"]
