"""The loss-spike guard: detectors on every step, a policy per detector (warn, skip the update, roll back
and skip the data, stop), and diagnosis of every incident. `callback.GuardCallback` is the whole of it as
the trainer sees it; `[guard]` in the config tunes it (docs/training.md, "The loss-spike guard")."""
