import os

from hypothesis import HealthCheck, settings

# CI gets more examples; local runs stay quick. Deadlines are off because
# share generation time depends on vector length, not on a bug.
settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")
