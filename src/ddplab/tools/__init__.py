"""Commands beside training: doctor, report, the collectives tour, the comm benchmark, the
checkpoint listing. May import every package but launch/'s command line."""
