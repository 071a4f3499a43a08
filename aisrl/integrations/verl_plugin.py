"""Importing this module registers aisrl's policy losses in verl (for verl's external-module hook):

    VERL_USE_EXTERNAL_MODULES=aisrl.integrations.verl_plugin python -m verl.trainer.main_ppo ... \
        actor_rollout_ref.actor.policy_loss.loss_mode=ais

verl imports the named module in every worker process, so the registration reaches the actors. This is the one
aisrl module whose import does something; use `aisrl.integrations.verl.install()` to register explicitly.
"""

from aisrl.integrations.verl import install

REGISTERED = install()
