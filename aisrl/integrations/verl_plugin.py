"""Importing this module registers aisrl's policy losses in verl (for verl's external-module hooks):

    python -m verl.trainer.main_ppo ... actor_rollout_ref.model.external_lib=aisrl.integrations.verl_plugin \
        actor_rollout_ref.actor.policy_loss.loss_mode=ais

verl's actor workers import `external_lib` when they build the model, on every node, so the registration reaches
the actors. `VERL_USE_EXTERNAL_MODULES=aisrl.integrations.verl_plugin` works too where every worker process sees
that variable (on a multi-node Ray cluster, pass it in Ray's runtime environment: the driver's environment does
not reach workers started with `ray start`). This is the one aisrl module whose import does something; use
`aisrl.integrations.verl.install()` to register explicitly.
"""

from aisrl.integrations.verl import install

REGISTERED = install()
