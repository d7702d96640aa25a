"""``impl/deploy``: the EFA deployment recipe for P and D vLLM servers with NIXL over LIBFABRIC, the
router, the bench and the ON/OFF report.

One TOML config (``deploy.toml``) is checked by :mod:`impl.deploy.config`, turned into exact command
lines by :mod:`impl.deploy.render`, and run by the thin launch scripts next to this file (each with
``--dry-run``). :mod:`impl.deploy.compare` prints the ON/OFF table. Walk-through: ``README.md`` here.
"""
