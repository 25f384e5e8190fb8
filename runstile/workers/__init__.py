"""Workers: the task registry, the Dramatiq side, and the RunContext tasks see."""
