"""The agent's serving core: what owns models and serves them (the bottom floor of the agent). It imports none of
the agent's transports, install or link code."""
