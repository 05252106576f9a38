"""Suite-wide settings.

Hypothesis: no per-example deadline and no too-slow health check anywhere. The suite runs on
busy 2-core CI machines where one garbage collection or preemption can stretch an example past
the default 200 ms, which Hypothesis reports as "Unreliable test timings" although nothing is
wrong; the properties themselves are what these tests check, never their speed (speed lives in
``benchmarks/``). Tests that set their own ``@settings`` keep them.
"""

from hypothesis import HealthCheck, settings

settings.register_profile("aurora", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("aurora")
