"""The elastic agent: starts, watches and restarts a node's workers (torch's ``elastic.agent``)."""
