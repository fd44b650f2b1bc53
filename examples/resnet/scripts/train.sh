#!/bin/sh
# Seed 003's scripts/train_gpu.sh for fleetlike: one node, NUM_CARDS GPUs or NPROC CPU workers.
#
#   NUM_CARDS=4 sh examples/resnet/scripts/train.sh                  # GPUs 0..3
#   NPROC=2 sh examples/resnet/scripts/train.sh                      # 2 CPU workers (the default)
#   sh examples/resnet/scripts/train.sh --use_local_sgd=True --local_sgd_steps=4   # more flags
#   MODEL=ResNet50 DATA_DIR=./ImageNet CLASS_DIM=1000 IMAGE_SHAPE=3,224,224 NUM_EPOCHS=120 \
#       NUM_CARDS=8 sh examples/resnet/scripts/train.sh --fp16=True
#
# scripts/train_multinode.sh runs this script with the node flags in LAUNCH_ARGS.
#
# The default data is the digits folder that make_dataset.py writes (made here if missing), and
# the defaults below are its recipe: ResNet18 at 32x32, 5 epochs. Logs: $LOG_DIR/workerlog.N;
# checkpoints, the served model and curves.png: $MODEL_SAVE_DIR. The same command run again
# resumes from the last epoch's checkpoint.
set -e
HERE=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
DATA_DIR=${DATA_DIR:-./ImageNet-digits}
MODEL=${MODEL:-ResNet18}
CLASS_DIM=${CLASS_DIM:-10}
IMAGE_SHAPE=${IMAGE_SHAPE:-3,32,32}
NUM_EPOCHS=${NUM_EPOCHS:-5}
BATCH_SIZE=${BATCH_SIZE:-32}
LR=${LR:-0.05}
LOG_DIR=${LOG_DIR:-log}
MODEL_SAVE_DIR=${MODEL_SAVE_DIR:-./output}

if [ -n "$SELECTED_GPUS" ]; then
    DEVICES="--selected_gpus=$SELECTED_GPUS"
elif [ -n "$NUM_CARDS" ]; then
    DEVICES="--selected_gpus=$(seq -s, 0 $((NUM_CARDS - 1)))"
else
    DEVICES="--nproc_per_node=${NPROC:-2}"
fi
if [ ! -f "$DATA_DIR/train.txt" ]; then
    "$PYTHON" "$HERE/make_dataset.py" --out "$DATA_DIR"
fi
# the digits recipe: crops of 60-100% of the image, no flip (a mirrored digit is another glyph)
exec "$PYTHON" -m fleetlike.launch $LAUNCH_ARGS $DEVICES --started_port="${STARTED_PORT:-auto}" --log_dir="$LOG_DIR" \
    "$HERE/train_with_fleet.py" \
    --model="$MODEL" --data_dir="$DATA_DIR" --class_dim="$CLASS_DIM" --image_shape="$IMAGE_SHAPE" \
    --num_epochs="$NUM_EPOCHS" --batch_size="$BATCH_SIZE" --lr="$LR" --lr_strategy=cosine_decay \
    --warm_up_epochs=1 --l2_decay=5e-4 --lower_scale=0.6 --random_flip=False \
    --model_save_dir="$MODEL_SAVE_DIR" "$@"
