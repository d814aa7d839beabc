#!/bin/bash
# lane.sh WAIT_FOR_NAME JOB... : waits for $ROOT/WAIT_FOR_NAME/train.end, then queue.sh 1 JOB...
ROOT=${ROOT:-/work/rt_out/s14/t}
while [ ! -f $ROOT/$1/train.end ]; do sleep 10; done
shift
exec /work/notes/s14/queue.sh 1 "$@"
