"""`orchestrator up`'s process launcher: what to start (specs), starting and signalling one child
(processes), keeping the children alive (supervisor: restarts with backoff, scaling), waiting
until the cluster serves (readiness), and the run that ties them together (run).

Torch-free and apart from the orchestrator's own logic: it starts the orchestrator process like
any other child and talks to it only over the protocol (ClusterInfoRequest).
"""
