"""Who runs the step: rank 0's engine thread (:mod:`.leader`) and a follower rank's
process (:mod:`.follower`)."""
