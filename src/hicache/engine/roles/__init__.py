"""The prefill/decode roles of a disaggregated instance (:mod:`.prefill`, :mod:`.decode`)
and how one is built at start (:mod:`.role_setup`); the hooks they fill are
:mod:`hicache.engine.role`."""
