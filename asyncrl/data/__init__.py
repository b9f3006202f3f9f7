"""Data between the queue and the learner.

    asyncrl.data.codec       msgpack encode/decode of RolloutGroup records (never pickle)
    asyncrl.data.batch       build_minibatches: advantages, step-wise merge, reduction weights,
                             TrainSequence records for one trainer step
    asyncrl.data.microbatch  cutting a mini-batch into micro-batches by token budget

This package file imports nothing, so each module can be imported on its own.
"""
