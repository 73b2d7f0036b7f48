"""Process groups inside (and, later, across) engine ranks: the rendezvous, the layout, the collectives.

World layout. A group spans ``dp_size`` DP ranks, each split into ``pp`` pipeline stages of ``tp``
tensor-parallel workers. A worker's world rank is::

    world_rank = dp * (PP * TP) + pp * TP + tp

so the TP ranks of one stage are adjacent (they talk most), the stages of one DP rank follow each other, and
DP ranks are the outermost blocks. Today every group is one DP rank (``dp_size`` 1, ``dp_rank`` 0): the
executor of a rank (``..executor``) starts TP x PP workers and joins them here. The DP dimension is in
the layout already so a process group spanning DP ranks (MoE expert parallelism) is the same call with
``dp_size > 1``.

Modules:
  ``context``    ParallelContext: what a model shard needs (coordinates, layers, collectives).
  ``groups``     init/destroy of torch.distributed groups and the collective helpers models call.

Nothing here is a module-level singleton: ``init_process_groups`` returns a ``ProcessGroups`` object that is
passed explicitly and can be destroyed and created again (a new ``generation`` uses a fresh store prefix),
so a group can be re-formed after a member dies.

The torch-free parts live in ``lbd.engine.config``: ``layout`` (ParallelLayout, the pipeline's layer split),
``placement`` (which CPUs and CUDA devices a rank and its workers get) and ``parallel`` (the start-up checks
of the TP/PP flags against the model and the devices).
"""
