/** A function called with an event's payload. */
export type Listener<T> = (payload: T) => void;

interface Registration<T> {
  listener: Listener<T>;
  once: boolean;
}

/**
 * An event emitter whose event names and payload types are checked by the
 * compiler: `Events` maps each event name to its payload type.
 */
export class TypedEmitter<Events extends Record<string, unknown>> {
  private listeners = new Map<keyof Events, Registration<any>[]>();
  private maxListeners: number;

  /**
   * @param maxListeners The most listeners one event may have; adding more
   *   throws.
   */
  constructor(maxListeners = 10) {
    this.maxListeners = maxListeners;
  }

  /**
   * Calls `listener` on every `event` until it is removed.
   * @returns A function that removes the listener.
   */
  on<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, false);
  }

  /**
   * Calls `listener` on the next `event` only.
   * @returns A function that removes the listener before it runs.
   */
  once<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, true);
  }

  /**
   * Removes the first registration of `listener` for `event`.
   * @returns Whether a listener was removed.
   */
  off<K extends keyof Events>(event: K, listener: Listener<Events[K]>): boolean {
    const regs = this.listeners.get(event);
    if (!regs) return false;
    const index = regs.findIndex((r) => r.listener === listener);
    if (index < 0) return false;
    regs.splice(index, 1);
    if (regs.length === 0) this.listeners.delete(event);
    return true;
  }

  /**
   * Calls every listener of `event` with `payload`, in the order they were
   * added; `once` listeners are removed before they run.
   * @returns The number of listeners called.
   */
  emit<K extends keyof Events>(event: K, payload: Events[K]): number {
    const regs = this.listeners.get(event);
    if (!regs) return 0;
    const current = [...regs];
    for (const reg of current) {
      if (reg.once) this.off(event, reg.listener);
      reg.listener(payload);
    }
    return current.length;
  }

  /** The number of listeners registered for `event`. */
  listenerCount<K extends keyof Events>(event: K): number {
    return this.listeners.get(event)?.length ?? 0;
  }

  /** Removes every listener of `event`, or of all events without one. */
  removeAll(event?: keyof Events): void {
    if (event === undefined) this.listeners.clear();
    else this.listeners.delete(event);
  }

  private add<K extends keyof Events>(
    event: K,
    listener: Listener<Events[K]>,
    once: boolean,
  ): () => void {
    const regs = this.listeners.get(event) ?? [];
    if (regs.length >= this.maxListeners) {
      throw new Error(`too many listeners for ${String(event)} (max ${this.maxListeners})`);
    }
    regs.push({ listener, once });
    this.listeners.set(event, regs);
    return () => {
      this.off(event, listener);
    };
  }
}
