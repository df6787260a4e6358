"""What several test modules share, so that no test module imports another.

- `builders`: groups, samples and configs of the trainer tests (char tokenizer, tiny-llama), publishing
  groups to a run's stream, reading metrics records, running a trainer in-process or as a process;
- `generators`: the generator tests' config, the test-side `FakeTrainer` (real publisher, queue and
  consumer) and `running_generator`;
- `runs`: `leeway run` on the demo (configs, a run to its end, a plumbing run's checks, what the stream and
  queue hold, a process's children);
- `ranks`: trainer rank processes (torch FSDP2 or megatron TP/PP/DP) that step, publish and checkpoint;
- `stores`: S3 stores on the test stack, `FaultyStore` (fault injection around a real store) and
  `LoseFirstPutResponse` (an HTTP proxy that loses one response);
- `tasks`: tasks with slow or hanging verifiers, named by `task.name=tests.support.tasks:...`;
- `waits`: `wait_until` and its async twin `until`: poll a predicate, fail naming what was awaited;
- `fakes`: fakes of the loops' collaborators for millisecond tests (`FakeWeightSource`, `FakeEngine`,
  `FakeSession`).
"""
