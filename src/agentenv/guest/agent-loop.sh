#!/run/agentenv/bin/busybox sh
# Runs the guest agent and starts it again if it dies (crash, OOM kill, `pkill -f agent.py`).
# A file of its own, so that its command line does not name the agent: killing the agent by
# name must not kill this loop too. Started by init in the agent's mount namespace.
T=/run/agentenv
while true; do
    $T/python/bin/python3 -E -s -S -u $T/agent/agent.py --host 0.0.0.0 --port 49983 --tools $T \
        --user-ns /proc/1/ns/mnt
    echo "aenv-init: agent exited with $?, restarting"
    $T/bin/busybox sleep 0.2
done
