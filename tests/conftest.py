import os

from hypothesis import HealthCheck, settings

# CI gets more examples; local runs stay quick. Deadlines are off because
# share generation time depends on vector length, not on a bug.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# Opt-in soak: HYPOTHESIS_SOAK=K multiplies every property's max_examples by K,
# including the explicit @settings(max_examples=...) of each test and the
# settings of stateful machines, so rare counterexamples surface locally
# before a CI run (not derandomized) meets them by chance.
_SOAK = int(os.environ.get("HYPOTHESIS_SOAK", "0") or 0)


def pytest_collection_modifyitems(config, items):
    """Scale max_examples of every hypothesis test when HYPOTHESIS_SOAK > 1 (and run only those)."""
    if _SOAK <= 1:
        return
    plain = [i for i in items if not getattr(getattr(i, "obj", None), "is_hypothesis_test", False)
             and i.get_closest_marker("soaks_inner_property") is None]
    if plain:  # example-based tests gain nothing from a soak
        config.hook.pytest_deselected(items=plain)
        items[:] = [i for i in items if i not in plain]
    seen = set()
    for item in items:
        fn = getattr(item, "obj", None)
        machine_case = item.cls if hasattr(fn, "_hypothesis_state_machine_class") else None
        key = id(machine_case or fn)
        if key in seen or not getattr(fn, "is_hypothesis_test", False):  # an inner property scales itself
            continue
        seen.add(key)
        if machine_case is not None:  # a RuleBasedStateMachine.TestCase keeps its settings on the class
            old = machine_case.settings
            machine_case.settings = settings(old, max_examples=old.max_examples * _SOAK)
        else:
            old = fn._hypothesis_internal_use_settings
            fn._hypothesis_internal_use_settings = settings(old, max_examples=old.max_examples * _SOAK)
