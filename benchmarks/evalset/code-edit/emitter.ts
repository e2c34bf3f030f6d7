export type Listener<T> = (payload: T) => void;

interface Registration<T> {
  listener: Listener<T>;
  once: boolean;
}

export class TypedEmitter<Events extends Record<string, unknown>> {
  private listeners = new Map<keyof Events, Registration<any>[]>();
  private maxListeners: number;

  constructor(maxListeners = 10) {
    this.maxListeners = maxListeners;
  }

  on<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, false);
  }

  once<K extends keyof Events>(event: K, listener: Listener<Events[K]>): () => void {
    return this.add(event, listener, true);
  }

  off<K extends keyof Events>(event: K, listener: Listener<Events[K]>): boolean {
    const regs = this.listeners.get(event);
    if (!regs) return false;
    const index = regs.findIndex((r) => r.listener === listener);
    if (index < 0) return false;
    regs.splice(index, 1);
    if (regs.length === 0) this.listeners.delete(event);
    return true;
  }

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

  listenerCount<K extends keyof Events>(event: K): number {
    return this.listeners.get(event)?.length ?? 0;
  }

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
