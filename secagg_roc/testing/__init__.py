"""A testing kit for sharing schemes: hypothesis strategies, property checks and a round state machine.

The project's own tests use exactly this kit for every scheme it ships, so a
researcher checks a scheme of their own -- any `secagg_roc.sharing.SharingScheme`
subclass -- in a few lines (needs the ``test`` extra: hypothesis)::

    from hypothesis import given
    from secagg_roc import testing as kit

    @given(kit.site_inputs())
    def test_my_scheme_is_exact(xs):
        kit.check_exact_reconstruction(MyScheme(3), xs)

    def test_my_scheme_hides_inputs():
        kit.check_coalitions_learn_nothing(MyScheme(3))

    TestMyRounds = kit.round_machine(lambda: MyScheme(3)).TestCase
"""

from .machines import round_machine
from .properties import (
    check_coalitions_learn_nothing,
    check_exact_reconstruction,
    check_tamper_detected,
    coalition_view,
    looks_uniform_and_input_independent,
    share_sum_combine,
)
from .strategies import ring_vectors, scheme_configs, schemes, site_inputs

__all__ = [
    "check_coalitions_learn_nothing",
    "check_exact_reconstruction",
    "check_tamper_detected",
    "coalition_view",
    "looks_uniform_and_input_independent",
    "ring_vectors",
    "round_machine",
    "scheme_configs",
    "schemes",
    "share_sum_combine",
    "site_inputs",
]
