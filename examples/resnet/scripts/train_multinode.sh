#!/bin/sh
# Seed 003's "other clusters" run: the same command on every node, each with its own NODE_IP.
#
#   on 192.168.1.2:
#     CLUSTER_NODE_IPS=192.168.1.2,192.168.1.3 NODE_IP=192.168.1.2 STARTED_PORT=6170 \
#         SELECTED_GPUS=0,1,2,3 sh examples/resnet/scripts/train_multinode.sh
#   on 192.168.1.3: the same with NODE_IP=192.168.1.3
#
# CPU nodes: NPROC=2 instead of SELECTED_GPUS. STARTED_PORT=auto lets each launcher choose free
# ports; the launchers then meet through RENDEZVOUS_FILE, a path on a filesystem every node
# shares (NFS, ...). Data, model, recipe and extra flags: as scripts/train.sh, which this runs.
# On PaddleCloud use --use_paddlecloud instead: the cloud's environment names the nodes.
set -e
: "${CLUSTER_NODE_IPS:?set CLUSTER_NODE_IPS to every node's IP, comma-separated, in rank order}"
: "${NODE_IP:?set NODE_IP to this node's IP (one of CLUSTER_NODE_IPS)}"
STARTED_PORT=${STARTED_PORT:-6170}
LAUNCH_ARGS="--cluster_node_ips=$CLUSTER_NODE_IPS --node_ip=$NODE_IP"
if [ "$STARTED_PORT" = auto ]; then
    : "${RENDEZVOUS_FILE:?STARTED_PORT=auto on several nodes needs RENDEZVOUS_FILE on a shared filesystem}"
    LAUNCH_ARGS="$LAUNCH_ARGS --rendezvous_file=$RENDEZVOUS_FILE"
fi
export STARTED_PORT LAUNCH_ARGS
exec sh "$(dirname "$0")/train.sh" "$@"
