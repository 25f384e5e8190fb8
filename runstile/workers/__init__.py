"""Workers: the Dramatiq side (actors, the embedded broker, leases, deliveries) and the RunContext tasks see."""
