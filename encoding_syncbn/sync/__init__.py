"""How the replicas meet and merge: the threads' protocol of a DataParallel call, how replicas
find their group, stream hand-offs, Chan's merge of statistics and its cross-process step.
Nothing here knows the layer."""
