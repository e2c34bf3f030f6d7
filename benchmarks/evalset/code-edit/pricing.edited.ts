// Cart pricing for the online bakery: discounts, delivery and VAT.

export interface CartLine {
  sku: string;
  unitPrice: number; // euros, VAT excluded
  quantity: number;
  category: "bread" | "pastry" | "cake" | "drink";
}

export const VAT_RATE = 0.07;
export const DRINK_VAT_RATE = 0.19;
export const FREE_DELIVERY_THRESHOLD = 50;
export const DELIVERY_FEE = 5.9;
export const BULK_QUANTITY = 10;
export const BULK_DISCOUNT = 0.1;
export const LOYALTY_DISCOUNT = 0.05;
export const MAX_DISCOUNT = 0.2;

export interface Quote {
  subtotal: number;
  discount: number;
  delivery: number;
  vat: number;
  total: number;
}

const round2 = (x: number): number => Math.round(x * 100) / 100;

export function lineTotal(line: CartLine): number {
  const gross = line.unitPrice * line.quantity;
  return line.quantity >= BULK_QUANTITY ? gross * (1 - BULK_DISCOUNT) : gross;
}

export function vatFor(line: CartLine, amount: number): number {
  const rate = line.category === "drink" ? DRINK_VAT_RATE : VAT_RATE;
  return amount * rate;
}

export function quote(lines: CartLine[], loyalty = false): Quote {
  const subtotal = lines.reduce((sum, l) => sum + l.unitPrice * l.quantity, 0);
  const afterBulk = lines.reduce((sum, l) => sum + lineTotal(l), 0);
  let discount = subtotal - afterBulk;
  if (loyalty) {
    discount += afterBulk * LOYALTY_DISCOUNT;
  }
  discount = Math.min(discount, subtotal * MAX_DISCOUNT);
  const net = subtotal - discount;
  const delivery = net >= FREE_DELIVERY_THRESHOLD || net === 0 ? 0 : DELIVERY_FEE;
  const share = subtotal > 0 ? net / subtotal : 0;
  const vat = lines.reduce((sum, l) => sum + vatFor(l, l.unitPrice * l.quantity * share), 0);
  return {
    subtotal: round2(subtotal),
    discount: round2(discount),
    delivery,
    vat: round2(vat),
    total: round2(net + delivery + vat),
  };
}

export function describe(q: Quote): string {
  return [
    `Subtotal  ${q.subtotal.toFixed(2)}`,
    `Discount -${q.discount.toFixed(2)}`,
    `Delivery  ${q.delivery.toFixed(2)}`,
    `VAT       ${q.vat.toFixed(2)}`,
    `Total     ${q.total.toFixed(2)}`,
  ].join("\n");
}
